"""Small pieces both training loops share: the schedule, window sampling, autocast.

Owns: `Progress` (a loop ends when its step count OR its wall-clock cap runs out,
whichever comes first, and the learning rate follows that same fraction, so a loop
cut short by the clock still anneals), the warmup + cosine learning-rate shape,
sampling training windows from a token stream, and the mixed-precision context
(bfloat16 autocast on CUDA, plain float32 on CPU).

Knows nothing about models, losses or files. Needs only torch.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch


class Progress:
    """Fraction done in [0, 1] = max(step / num_steps, elapsed / max_seconds)."""

    def __init__(self, num_steps: int, max_seconds: float | None) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps!r}")
        if max_seconds is not None and max_seconds <= 0:
            raise ValueError(f"max_seconds must be positive, got {max_seconds!r}")
        self.num_steps = num_steps
        self.max_seconds = max_seconds
        self.started = time.monotonic()
        self.step = 0

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def fraction(self) -> float:
        by_steps = self.step / self.num_steps
        by_clock = self.elapsed_s / self.max_seconds if self.max_seconds else 0.0
        return min(1.0, max(by_steps, by_clock))

    @property
    def stopped_by_clock(self) -> bool:
        return self.step < self.num_steps

    def done(self) -> bool:
        return self.fraction >= 1.0


def lr_at(fraction: float, peak_lr: float, warmup_fraction: float, final_ratio: float) -> float:
    """Linear warmup to peak_lr, then cosine down to final_ratio·peak_lr."""
    if fraction < warmup_fraction:
        return peak_lr * max(fraction, 1e-3) / warmup_fraction
    t = (fraction - warmup_fraction) / max(1e-9, 1.0 - warmup_fraction)
    return peak_lr * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def sample_windows(tokens: torch.Tensor, batch_size: int, length: int,
                   gen: torch.Generator) -> torch.Tensor:
    """[batch_size, length] random contiguous windows of a 1-D token tensor (same device)."""
    if tokens.numel() <= length:
        raise ValueError(f"need more than {length} tokens, got {tokens.numel()}")
    starts = torch.randint(0, tokens.numel() - length, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(length)[None, :]
    return tokens[idx.to(tokens.device)]


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def log(tag: str, message: str) -> None:
    print(f"[{tag}] {message}", flush=True)
