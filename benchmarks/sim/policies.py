"""The policies the simulator compares, behind one small interface (`SpecPolicy`).

* `FixedK`: one K for every step; the engine reserves K lookahead slots.
* `StaticTable`: vLLM-style `num_speculative_tokens_per_batch_size`, fixed at engine start.
  `StaticTable.tuned` builds the table an operator would write from the calibration and a
  generic acceptance prior (the best K per batch size under that prior), then never
  changes it: the strongest thing vLLM offers today without knowing the workload.
* `CandidateSets`: SGLang-style adaptive speculation as REFERENCE.md describes it: the
  candidate K set depends on the batch size ({1,3,5,7} below 8, {0,1,3} below 32, {0,1}
  below 64, {0} from 64); a preferred tier moves up one candidate when an EMA of the draft
  acceptance rate (accepted / drafted tokens) is >= 0.7 and down one when < 0.4, and each
  step runs the largest candidate its batch size allows not above the tier. An
  approximation of the idea (EMA-driven tiers within batch-size candidate sets), not a
  port of SGLang's code.
* `ControllerArm`: runs the pure controller (control.policy.decide) once per interval and
  applies its per-replica schedules, exactly as an engine wrapper would.

Stateful adapters are fine here: the decision logic they wrap stays pure. Knows nothing
about the simulator's internals beyond the `SpecPolicy` protocol.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from control.model import StepCostModel, goodput_grid
from control.policy import (ControllerConfig, Decision, ReplicaSignals, decide, dense_from_schedule, initial_state,
                            schedule_from_table)

SGLANG_CANDIDATES: tuple[tuple[int, tuple[int, ...]], ...] = (
    (1, (1, 3, 5, 7)), (8, (0, 1, 3)), (32, (0, 1)), (64, (0,)),
)


class FixedK:
    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens
        self.name = f"fixed K={num_speculative_tokens}"
        self.num_lookahead_tokens = num_speculative_tokens

    def start(self, replica_ids: Sequence[str]) -> None:
        pass

    def num_speculative_tokens(self, replica_id: str, batch_size: int) -> int:
        return self.k

    def on_interval(self, now_s: float, signals: Sequence[ReplicaSignals]) -> str | None:
        return None


class StaticTable:
    def __init__(self, schedule: Sequence[Sequence[int]], max_num_seqs: int, name: str = "vLLM static table"):
        self.schedule = tuple(tuple(int(x) for x in r) for r in schedule)
        self.num_lookahead_tokens = max(k for _, _, k in self.schedule)
        self._dense = dense_from_schedule(self.schedule, max_num_seqs, max(1, self.num_lookahead_tokens))
        self.name = name

    @classmethod
    def tuned(cls, cost: StepCostModel, acceptance_prior: Sequence[float], max_num_speculative_tokens: int,
              max_num_seqs: int, num_context_tokens_per_req: float = 512.0) -> "StaticTable":
        g = goodput_grid(cost, acceptance_prior, np.arange(1, max_num_seqs + 1), max_num_speculative_tokens,
                         num_context_tokens_per_req)
        return cls(schedule_from_table([int(k) for k in np.argmax(g, axis=1)]), max_num_seqs)

    def start(self, replica_ids: Sequence[str]) -> None:
        pass

    def num_speculative_tokens(self, replica_id: str, batch_size: int) -> int:
        return self._dense[min(batch_size, len(self._dense)) - 1]

    def on_interval(self, now_s: float, signals: Sequence[ReplicaSignals]) -> str | None:
        return None


class CandidateSets:
    def __init__(self, candidates=SGLANG_CANDIDATES, ema_weight: float = 0.3, step_up_rate: float = 0.7,
                 step_down_rate: float = 0.4, initial_k: int = 3):
        self.candidates = candidates
        self.tiers = sorted({k for _, ks in candidates for k in ks if k > 0})
        self.ema_weight, self.step_up_rate, self.step_down_rate = ema_weight, step_up_rate, step_down_rate
        self.preferred_k = initial_k
        self.ema_rate: float | None = None  # accepted drafts / drafted tokens
        self.num_lookahead_tokens = max(self.tiers)
        self.name = "SGLang-style candidate sets"

    def start(self, replica_ids: Sequence[str]) -> None:
        pass

    def num_speculative_tokens(self, replica_id: str, batch_size: int) -> int:
        """The largest candidate allowed at this batch size not above the preferred tier."""
        cands = [ks for lo, ks in self.candidates if batch_size >= lo][-1]
        below = [k for k in cands if k <= self.preferred_k]
        return max(below) if below else min(cands)

    def on_interval(self, now_s: float, signals: Sequence[ReplicaSignals]) -> str | None:
        drafted = sum(sum(s.num_drafts_per_pos) for s in signals)
        if not drafted:
            return None
        rate = sum(sum(s.num_accepted_per_pos) for s in signals) / drafted
        self.ema_rate = rate if self.ema_rate is None else self.ema_rate + self.ema_weight * (rate - self.ema_rate)
        i = self.tiers.index(self.preferred_k) if self.preferred_k in self.tiers else 0
        if self.ema_rate >= self.step_up_rate and i + 1 < len(self.tiers):
            self.preferred_k, self.ema_rate = self.tiers[i + 1], None
        elif self.ema_rate < self.step_down_rate and i > 0:
            self.preferred_k, self.ema_rate = self.tiers[i - 1], None
        else:
            return None
        return f"tier -> K={self.preferred_k} (draft acceptance rate {rate:.2f})"


class ControllerArm:
    def __init__(self, config: ControllerConfig, name: str = "controller"):
        self.config = config
        self.name = name
        self.num_lookahead_tokens = config.max_num_speculative_tokens
        self.decisions: list[tuple[float, Decision]] = []

    def start(self, replica_ids: Sequence[str]) -> None:
        self.state = initial_state(self.config, len(replica_ids))
        self._dense = {rid: list(self.state.k_by_batch) for rid in replica_ids}

    def num_speculative_tokens(self, replica_id: str, batch_size: int) -> int:
        table = self._dense[replica_id]
        return table[min(batch_size, len(table)) - 1]

    def on_interval(self, now_s: float, signals: Sequence[ReplicaSignals]) -> str | None:
        decision, self.state = decide(signals, self.state, self.config)
        kmax, n = self.config.max_num_speculative_tokens, self.config.max_num_seqs
        for rid, schedule in decision.schedules.items():
            self._dense[rid] = dense_from_schedule(schedule, n, kmax)
        self.decisions.append((now_s, decision))
        return decision.reason if decision.changed or decision.probe_replica else None
