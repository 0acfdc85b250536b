"""Train the tiny Llama target on the corpus; held-out perplexity vs a unigram baseline.

Owns: the target's training recipe (next-token cross-entropy on random windows,
AdamW, warmup + cosine, gradient clipping), the rule that special tokens are never
targets (the corpus ends each file with `<|eos|>`, which the model reads as a
boundary but is never taught to emit, so its generations run to max_tokens as the
random models' did), and the two perplexities it reports on the held-out split.
One optimizer step is `target_step` (no randomness of its own: the caller samples
the windows); `train_target` is the one-go loop around it that `models.train_core`
runs, `models.train_chunks` the resumable one.

Knows nothing about files, tokenizers, heads or vLLM. Needs only torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from models.spec import TinySpec
from models.torch_llama import TinyLlama
from models.train_common import Progress, autocast, log, lr_at, sample_windows

NUM_SPECIAL_TOKENS = 8  # ids 0..7 (models.tokenizer.SPECIAL_TOKENS)
IGNORE = -100


@dataclass(frozen=True)
class TargetConfig:
    steps: int
    batch_size: int  # windows per step
    seq_len: int  # tokens per window
    peak_lr: float = 3e-3
    warmup_fraction: float = 0.05
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_seconds: float | None = None  # wall-clock cap; the schedule follows it too
    eval_windows: int = 256  # held-out windows scored at the end (all of val if fewer)
    log_every: int = 100


def _targets(windows: torch.Tensor) -> torch.Tensor:
    labels = windows[:, 1:].clone()
    labels[labels < NUM_SPECIAL_TOKENS] = IGNORE
    return labels


def unigram_perplexity(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> float:
    """Add-one-smoothed unigram over non-special tokens, scored on val's non-special tokens."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    counts[:NUM_SPECIAL_TOKENS] = 0.0
    log_p = (counts / counts.sum()).log()
    scored = val[val >= NUM_SPECIAL_TOKENS]
    return math.exp(float(-log_p[scored].mean()))


@torch.no_grad()
def held_out_perplexity(model: TinyLlama, val: torch.Tensor, seq_len: int,
                        max_windows: int, batch_size: int = 16) -> float:
    """Perplexity over consecutive non-overlapping windows of val (the first
    max_windows of them), non-special targets only."""
    device = next(model.parameters()).device
    n = min(max_windows, (val.numel() - 1) // seq_len)
    if n < 1:
        raise ValueError(f"val has {val.numel()} tokens, fewer than one window of {seq_len}")
    windows = val[: n * seq_len + 1]
    starts = torch.arange(n) * seq_len
    total, count = 0.0, 0
    model.eval()
    for i in range(0, n, batch_size):
        idx = starts[i:i + batch_size, None] + torch.arange(seq_len + 1)[None, :]
        batch = windows[idx].to(device)
        with autocast(device):
            logits, _ = model(batch[:, :-1])
        labels = _targets(batch)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                               ignore_index=IGNORE, reduction="sum")
        total += float(loss)
        count += int((labels != IGNORE).sum())
    model.train()
    return math.exp(total / count)


def make_optimizer(model: TinyLlama, cfg: TargetConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (norm weights are not decayed)."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.peak_lr, betas=(0.9, 0.95), eps=1e-8,
        **({"fused": True} if device.type == "cuda" else {}),
    )


def target_step(model: TinyLlama, optim: torch.optim.Optimizer, windows: torch.Tensor,
                lr: float, cfg: TargetConfig) -> torch.Tensor:
    """One optimizer step on windows [B, seq_len + 1] at learning rate lr; returns the
    detached loss (no host sync). Uses no randomness of its own."""
    device = windows.device
    for group in optim.param_groups:
        group["lr"] = lr
    with autocast(device):
        logits, _ = model(windows[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), _targets(windows).flatten(),
                           ignore_index=IGNORE)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optim.step()
    return loss.detach()


def loss_summary(losses: list[float]) -> tuple[float, float]:
    """(first, final): mean of the first 5 losses, mean of the last 5% (at least one)."""
    head = sum(losses[:5]) / min(5, len(losses))
    tail = losses[-max(1, len(losses) // 20):]
    return round(head, 4), round(sum(tail) / len(tail), 4)


def evaluate_target(model: TinyLlama, corpus: dict, spec: TinySpec, cfg: TargetConfig) -> dict:
    """The two held-out perplexities the metrics report."""
    return {
        "val_perplexity": round(held_out_perplexity(
            model, corpus["val"], cfg.seq_len, cfg.eval_windows), 3),
        "unigram_val_perplexity": round(unigram_perplexity(
            corpus["train"], corpus["val"], spec.vocab_size), 3),
    }


def train_target(corpus: dict, spec: TinySpec, cfg: TargetConfig, device: torch.device,
                 seed: int) -> tuple[TinyLlama, dict]:
    """Returns the trained model (on device) and a metrics dict."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TinyLlama(spec)
    model.init_weights(seed)
    model.to(device).train()
    train_tokens = corpus["train"].to(device)
    optim = make_optimizer(model, cfg, device)
    progress = Progress(cfg.steps, cfg.max_seconds)
    loss_history: list[torch.Tensor] = []  # detached, read once at the end (no per-step sync)
    while not progress.done():
        lr = lr_at(progress.fraction, cfg.peak_lr, cfg.warmup_fraction, cfg.final_lr_ratio)
        windows = sample_windows(train_tokens, cfg.batch_size, cfg.seq_len + 1, gen)
        loss = target_step(model, optim, windows, lr, cfg)
        progress.step += 1
        loss_history.append(loss)
        if progress.step % cfg.log_every == 0 or progress.step == 1:
            tok_s = progress.step * cfg.batch_size * cfg.seq_len / progress.elapsed_s
            log("target", f"step {progress.step}/{cfg.steps} loss {loss.item():.3f} "
                f"lr {lr:.2e} {tok_s / 1e3:.0f}k tok/s {progress.elapsed_s:.0f}s")
    losses = torch.stack(loss_history).float().cpu().tolist()
    first_loss, final_loss = loss_summary(losses)
    metrics = {
        "config": asdict(cfg),
        "steps_run": progress.step,
        "stopped_by_clock": progress.stopped_by_clock,
        "seconds": round(progress.elapsed_s, 1),
        "tokens_seen": progress.step * cfg.batch_size * cfg.seq_len,
        "first_loss": first_loss,
        "final_loss": final_loss,
        **evaluate_target(model, corpus, spec, cfg),
    }
    log("target", f"done: {metrics['steps_run']} steps in {metrics['seconds']}s, loss "
        f"{metrics['first_loss']} -> {metrics['final_loss']}, val ppl "
        f"{metrics['val_perplexity']} (unigram {metrics['unigram_val_perplexity']})")
    return model, metrics
