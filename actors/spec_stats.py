"""Spec-decode and throughput statistics as plain data.

Counters grow by `observe_*`; everything a person reads (per-position acceptance, mean
acceptance length, output tokens/s) is a derived property. No vLLM, Ray or torch import:
the engine wrapper feeds it from vLLM's per-step stats, the pool merges the actors'
copies, and exporters (logs, summaries, Prometheus) only read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodeStats:
    """Cumulative counters of one engine (or, after `merge`, of a pool)."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_steps: int = 0
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None

    def observe_drafts(
        self,
        num_drafts: int,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        num_accepted_tokens_per_pos: list[int],
    ) -> None:
        """One engine step's spec-decode numbers (vLLM's `SpecDecodingStats`)."""
        self.num_drafts += num_drafts
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        width = max(len(self.num_accepted_tokens_per_pos), len(num_accepted_tokens_per_pos))
        self.num_spec_tokens = max(self.num_spec_tokens, width)
        self._widen(width)
        for i, n in enumerate(num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += n

    def observe_tokens(self, num_prompt_tokens: int, num_output_tokens: int, now_s: float) -> None:
        """One engine step's token counts, with the wall-clock time it was seen."""
        self.num_steps += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_output_tokens += num_output_tokens
        if num_output_tokens:
            if self.first_token_time_s is None:
                self.first_token_time_s = now_s
            self.last_token_time_s = now_s

    def _widen(self, width: int) -> None:
        self.num_accepted_tokens_per_pos += [0] * (width - len(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_per_pos(self) -> list[float]:
        """Unconditional acceptance at each draft position: accepted_at_pos / drafts."""
        if not self.num_drafts:
            return [0.0] * len(self.num_accepted_tokens_per_pos)
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos]

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per draft-verify step, counting the bonus token: 1 + accepted/drafts.
        None when nothing was drafted."""
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def draft_acceptance_rate(self) -> float | None:
        """accepted / draft tokens. Falls as K grows by construction; prefer the two above."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def output_tokens_per_s(self) -> float | None:
        """Output tokens over the span from the first to the last token seen."""
        if self.first_token_time_s is None or self.last_token_time_s is None:
            return None
        span = self.last_token_time_s - self.first_token_time_s
        return self.num_output_tokens / span if span > 0 else None

    def merge(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        """Sum of two engines' counters (a pool view); time span is the union."""
        out = SpecDecodeStats(**{**self.__dict__, "num_accepted_tokens_per_pos": []})
        out.observe_drafts(
            other.num_drafts,
            other.num_draft_tokens,
            other.num_accepted_tokens,
            other.num_accepted_tokens_per_pos,
        )
        out._widen(len(self.num_accepted_tokens_per_pos))
        for i, n in enumerate(self.num_accepted_tokens_per_pos):
            out.num_accepted_tokens_per_pos[i] += n
        out.num_prompt_tokens += other.num_prompt_tokens
        out.num_output_tokens += other.num_output_tokens
        out.num_steps += other.num_steps
        starts = [t for t in (self.first_token_time_s, other.first_token_time_s) if t is not None]
        ends = [t for t in (self.last_token_time_s, other.last_token_time_s) if t is not None]
        out.first_token_time_s = min(starts) if starts else None
        out.last_token_time_s = max(ends) if ends else None
        return out

    def as_dict(self) -> dict[str, Any]:
        """Counters plus derived values, JSON-ready (for summaries and logs)."""
        return {
            **self.__dict__,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_per_pos": [round(a, 4) for a in self.acceptance_per_pos],
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "output_tokens_per_s": self.output_tokens_per_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SpecDecodeStats":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})
