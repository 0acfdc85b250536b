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


@dataclass
class StepWindow:
    """Per-step measurements since the last `drain`, for the speculation controller.

    vLLM reports each step's drafts and accepted tokens per position, but not which K
    the step ran at nor how many drafts reached each position once K varies by batch
    size; both follow from the step's own numbers (every request in a step drafts the
    same K, so K = draft tokens / drafts). Step time is the gap to the previous step,
    counted only for decode steps while the engine runs back to back. `busy` keeps every
    step run back to back (prefills and mixed steps too) with the output tokens it
    produced: the engine's time per output token as it really ran, which the decode-step
    times alone miss."""

    max_gap_s: float = 0.5
    drafts_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    # (batch size, K) -> [steps, seconds, prefill tokens, context tokens per request]
    cells: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    # (batch size, K) -> [steps, seconds, output tokens], every step timed back to back
    busy: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    # K -> every step that ran at it (with requests), timed or not: what the engine ran
    num_steps_by_k: dict[int, int] = field(default_factory=dict)
    last_step_s: float | None = None
    last_batch_size: int = 0

    def observe_step(
        self,
        now_s: float,
        batch_size: int,
        num_drafts: int,
        num_draft_tokens: int,
        accepted_per_pos: list[int],
        num_prefill_tokens: int = 0,
        context_tokens_per_req: float = 0.0,
        num_output_tokens: int = 0,
    ) -> None:
        k = round(num_draft_tokens / num_drafts) if num_drafts else 0
        width = max(k, len(accepted_per_pos))
        for counts in (self.drafts_per_pos, self.accepted_per_pos):
            counts += [0] * (width - len(counts))
        for i in range(k):
            self.drafts_per_pos[i] += num_drafts
        for i, n in enumerate(accepted_per_pos):
            self.accepted_per_pos[i] += n
        if batch_size > 0:
            self.num_steps_by_k[k] = self.num_steps_by_k.get(k, 0) + 1
        gap = None if self.last_step_s is None else now_s - self.last_step_s
        busy_before = self.last_batch_size > 0
        self.last_step_s, self.last_batch_size = now_s, batch_size
        # A decode step's time is the gap to the previous step only while the engine ran
        # back to back: not after an idle spell (the gap holds the idle time) and not for
        # a step that prefilled (a different cost; the model's prefill term is not fitted
        # on CPU).
        back_to_back = batch_size > 0 and busy_before and gap is not None and gap <= self.max_gap_s
        if back_to_back:
            cell = self.busy.setdefault((batch_size, k), [0, 0.0, 0])
            cell[0] += 1
            cell[1] += gap
            cell[2] += num_output_tokens
        if back_to_back and not num_prefill_tokens:
            cell = self.cells.setdefault((batch_size, k), [0, 0.0, 0.0, 0.0])
            cell[0] += 1
            cell[1] += gap
            cell[2] += num_prefill_tokens
            cell[3] += context_tokens_per_req

    def skip_next_gap(self) -> None:
        """Do not count the next step's gap as its step time (it straddles something
        that is not a step, such as a K table change the engine core handled between
        steps)."""
        self.last_step_s = None

    def drain(self) -> dict[str, Any]:
        """Everything since the last drain, and start a new window."""
        out = {
            "drafts_per_pos": list(self.drafts_per_pos),
            "accepted_per_pos": list(self.accepted_per_pos),
            "steps": [
                {"batch_size": b, "num_speculative_tokens": k, "num_steps": int(n),
                 "mean_step_time_s": t / n, "mean_prefill_tokens": p / n,
                 "mean_context_tokens_per_req": c / n}
                for (b, k), (n, t, p, c) in sorted(self.cells.items())
            ],
            "busy": [
                {"batch_size": b, "num_speculative_tokens": k, "num_steps": int(n), "seconds": t,
                 "output_tokens": int(o)}
                for (b, k), (n, t, o) in sorted(self.busy.items())
            ],
            "num_steps_by_k": dict(sorted(self.num_steps_by_k.items())),
        }
        self.drafts_per_pos, self.accepted_per_pos, self.cells, self.num_steps_by_k = [], [], {}, {}
        self.busy = {}
        return out
