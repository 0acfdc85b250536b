"""The goodput model: tokens per step τ(K), step time T(B, K) and the KV-slot limit.

Owns the arithmetic the controller, the calibration fit and the simulator share:

* τ(K) = 1 + Σ_{i≤K} p_i, with p_i the unconditional acceptance at draft position i
  (accepted_at_pos[i] / drafts that reached position i; the 1 is the bonus token).
* T(B, K) = fixed + per_token·n + moe_weight_load·(1 − (1 − k/E)^n) + per_kv_token·ctx
  + draft, with n = B·(K+1) + prefill tokens batched into the step. The MoE term is the
  cost of loading the experts the step's tokens touch (n tokens routed to k of E
  experts touch a fraction 1 − (1 − k/E)^n of them): that is why small batches of an
  MoE model are cheaper per token than the linear term alone predicts.
  Draft cost = spec_overhead + passes·draft_pass + draft_per_token·B·K, where
  spec_overhead is what any speculating step pays (rejection sampling, bookkeeping) and
  passes = 1 for P-EAGLE
  (`drafting="parallel"`: all K drafts in one forward pass, so its cost is nearly flat in
  K) and passes = K for EAGLE-3 (`drafting="sequential"`). K = 0 drafts nothing.
* Goodput of a replica = B·τ(K) / T(B, K) output tokens per second.
* KV: vLLM reserves `lookahead` extra slots per running request (it reserves
  `num_speculative_tokens` fixed at engine start, whatever K a step then uses), so a
  larger start-up K shrinks the batch the KV cache admits.

Knows nothing about where the numbers come from (calibration files, measured signals),
about policies or simulation, and imports only the standard library and numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal, Sequence

import numpy as np

Drafting = Literal["parallel", "sequential"]

#: Names of the linear cost features, in the order `StepCostModel.features` returns them.
FEATURE_NAMES = (
    "fixed_s",
    "per_token_s",
    "moe_weight_load_s",
    "per_kv_token_s",
    "spec_overhead_s",
    "draft_pass_s",
    "draft_per_token_s",
)


@dataclass(frozen=True)
class StepCostModel:
    """Step time of one replica, linear in its coefficients (so least squares fits it).

    Every coefficient is in seconds (per step, per batched token, per KV token, ...)."""

    fixed_s: float
    per_token_s: float
    moe_weight_load_s: float = 0.0
    moe_num_experts: int = 0
    moe_experts_per_token: int = 0
    per_kv_token_s: float = 0.0
    spec_overhead_s: float = 0.0
    draft_pass_s: float = 0.0
    draft_per_token_s: float = 0.0
    drafting: Drafting = "parallel"
    # What a speculating engine pays on a K=0 step that an engine started without
    # speculation does not: vLLM 0.32 still runs the drafter's first pass on K=0 steps
    # (to keep the draft KV cache in sync). Seconds per step, plus per running request.
    # Not part of the fitted features: measured against a plain engine (tools.profile_steps).
    k0_draft_fixed_s: float = 0.0
    k0_draft_per_req_s: float = 0.0

    def __post_init__(self) -> None:
        for name in FEATURE_NAMES + ("k0_draft_fixed_s", "k0_draft_per_req_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"StepCostModel.{name} must be a finite number >= 0, got {value!r}")
        if self.drafting not in ("parallel", "sequential"):
            raise ValueError(f"drafting must be 'parallel' or 'sequential', got {self.drafting!r}")
        if self.moe_weight_load_s and not (0 < self.moe_experts_per_token <= self.moe_num_experts):
            raise ValueError(
                "moe_weight_load_s needs 0 < moe_experts_per_token <= moe_num_experts, got "
                f"{self.moe_experts_per_token!r} of {self.moe_num_experts!r}"
            )

    def features(
        self,
        batch_size: float,
        num_speculative_tokens: int,
        num_context_tokens: float = 0.0,
        num_prefill_tokens: float = 0.0,
    ) -> tuple[float, ...]:
        """The regressors of `step_time_s`, one per entry of FEATURE_NAMES."""
        k = num_speculative_tokens
        num_tokens = batch_size * (k + 1) + num_prefill_tokens
        moe = 0.0
        if self.moe_num_experts:
            miss = 1.0 - self.moe_experts_per_token / self.moe_num_experts
            moe = 1.0 - miss**num_tokens
        passes = 0 if k == 0 else (1 if self.drafting == "parallel" else k)
        return (1.0, num_tokens, moe, num_context_tokens, float(k > 0), float(passes), batch_size * k)

    def coefficients(self) -> tuple[float, ...]:
        return self._coefficients

    @cached_property
    def _coefficients(self) -> tuple[float, ...]:
        # Cached: step_time_s runs once per simulated step (benchmarks.sim.simulator).
        return tuple(float(getattr(self, name)) for name in FEATURE_NAMES)

    def with_coefficients(self, values: Sequence[float]) -> "StepCostModel":
        return replace(self, **dict(zip(FEATURE_NAMES, (float(v) for v in values))))

    def step_time_s(
        self,
        batch_size: float,
        num_speculative_tokens: int,
        num_context_tokens: float = 0.0,
        num_prefill_tokens: float = 0.0,
    ) -> float:
        """Seconds for one engine step: B running requests verifying K drafts each, plus
        `num_prefill_tokens` of prefill batched in, with `num_context_tokens` of KV read."""
        f = self.features(batch_size, num_speculative_tokens, num_context_tokens, num_prefill_tokens)
        c = self._coefficients
        # Written out (not a sum over zip): this runs once per simulated step.
        return c[0] * f[0] + c[1] * f[1] + c[2] * f[2] + c[3] * f[3] + c[4] * f[4] + c[5] * f[5] + c[6] * f[6]


def plain_step_time_s(cost: StepCostModel, batch_size: float, num_context_tokens: float = 0.0) -> float:
    """Seconds per step of an engine started without speculation: the K=0 step of a
    speculating engine less its drafter's pass (`k0_draft_*`), never below a tenth of it."""
    with_drafter = cost.step_time_s(batch_size, 0, num_context_tokens)
    saved = cost.k0_draft_fixed_s + cost.k0_draft_per_req_s * batch_size
    return max(with_drafter - saved, 0.1 * with_drafter)


def tokens_per_step(acceptance_per_pos: Sequence[float], num_speculative_tokens: int) -> float:
    """τ(K) = 1 + Σ_{i≤K} p_i. Positions beyond the known vector count as 0 acceptance."""
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens!r}")
    return 1.0 + float(sum(acceptance_per_pos[:num_speculative_tokens]))


def geometric_acceptance(alpha: float, num_positions: int) -> tuple[float, ...]:
    """p_i = α^i: every draft is accepted with probability α given the previous one was."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha!r}")
    return tuple(alpha**i for i in range(1, num_positions + 1))


def goodput_tokens_per_s(
    cost: StepCostModel,
    acceptance_per_pos: Sequence[float],
    batch_size: float,
    num_speculative_tokens: int,
    num_context_tokens_per_req: float = 0.0,
) -> float:
    """Output tokens per second of one replica running `batch_size` requests at K."""
    if batch_size <= 0:
        return 0.0
    step_s = cost.step_time_s(
        batch_size, num_speculative_tokens, batch_size * num_context_tokens_per_req
    )
    return batch_size * tokens_per_step(acceptance_per_pos, num_speculative_tokens) / step_s


def step_time_grid_s(
    cost: StepCostModel,
    batch_sizes: Sequence[float],
    max_num_speculative_tokens: int,
    num_context_tokens_per_req: float = 0.0,
) -> np.ndarray:
    """T(B, K) as an array [len(batch_sizes), K_max + 1]: row b, column K."""
    b = np.asarray(batch_sizes, dtype=float)
    coef = cost.coefficients()
    cols = []
    for k in range(max_num_speculative_tokens + 1):
        f = cost.features(b, k, b * num_context_tokens_per_req)
        cols.append(sum(c * x for c, x in zip(coef, f)) * np.ones_like(b))
    return np.stack(cols, axis=1)


def goodput_grid(
    cost: StepCostModel,
    acceptance_per_pos: Sequence[float],
    batch_sizes: Sequence[float],
    max_num_speculative_tokens: int,
    num_context_tokens_per_req: float = 0.0,
) -> np.ndarray:
    """Goodput B·τ(K)/T(B, K) as an array [len(batch_sizes), K_max + 1]."""
    b = np.asarray(batch_sizes, dtype=float)
    tau = np.array([tokens_per_step(acceptance_per_pos, k) for k in range(max_num_speculative_tokens + 1)])
    step_s = step_time_grid_s(cost, b, max_num_speculative_tokens, num_context_tokens_per_req)
    return b[:, None] * tau[None, :] / step_s


def best_num_speculative_tokens(
    cost: StepCostModel,
    acceptance_per_pos: Sequence[float],
    batch_size: float,
    max_num_speculative_tokens: int,
    num_context_tokens_per_req: float = 0.0,
) -> int:
    """argmax_K goodput at this batch size (ties go to the smaller K: less KV, less risk)."""
    values = [
        goodput_tokens_per_s(cost, acceptance_per_pos, batch_size, k, num_context_tokens_per_req)
        for k in range(max_num_speculative_tokens + 1)
    ]
    return int(np.argmax(values))


def max_batch_size(
    kv_capacity_tokens: int,
    num_context_tokens_per_req: float,
    num_lookahead_tokens: int,
    max_num_seqs: int,
) -> int:
    """Largest batch the KV cache holds when each request needs its context plus the
    lookahead slots reserved for drafts (vLLM: num_speculative_tokens at start-up)."""
    per_req = num_context_tokens_per_req + num_lookahead_tokens + 1
    if per_req <= 0:
        raise ValueError(f"tokens per request must be > 0, got {per_req!r}")
    return max(0, min(max_num_seqs, int(kv_capacity_tokens // per_req)))
