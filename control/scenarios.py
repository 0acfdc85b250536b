"""The standard comparison: workloads, traces, the policy line-up, and how to run them.

Owns the experiment the benchmark prints and the tests check on a reduced size: a
concurrency sweep (one replica, closed loop, one workload) and time-varying traces, each
policy run on the same seed, plus the model ceiling of a trace: the goodput of the best
K per phase (from the same model, at B = concurrency) over the best single fixed K. The
ceiling bounds what any policy can gain over fixed K on that trace, so a target above it
is unreachable whatever the controller does.

Knows nothing about printing or plotting (benchmarks/controller_sim.py does that).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from control.acceptance import prior_estimate
from control.baselines import CandidateSets, ControllerArm, FixedK, StaticTable
from control.calibration import MT_BENCH_ACCEPTANCE, Calibration
from control.model import goodput_grid
from control.policy import ControllerConfig
from control.simulator import Phase, PoolConfig, SimResult, SpecPolicy, Workload, simulate

FIXED_KS = (0, 3, 7, 11)
SWEEP_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXT_TOKENS_PER_REQ = 512.0


def code_workload(cal: Calibration) -> Workload:
    """The calibration's own workload (HumanEval-like code, acceptance from the fit)."""
    return Workload("code", tuple(cal.acceptance_per_pos), prompt_tokens=200, mean_output_tokens=320)


def chat_workload(num_positions: int = 11) -> Workload:
    """Lower acceptance: the published MT-Bench per-position vector, extended geometrically."""
    acc = prior_estimate(MT_BENCH_ACCEPTANCE, num_positions, 1.0).acceptance_per_pos
    return Workload("chat", tuple(round(p, 4) for p in acc), prompt_tokens=400, mean_output_tokens=400)


def load_trace(workload: Workload, phase_s: float) -> list[Phase]:
    """One workload, concurrency moving across the whole range and back."""
    return [Phase(phase_s, c, workload) for c in (1, 4, 16, 64, 128, 32, 8, 2, 96, 24)]


def day_night_trace(code: Workload, chat: Workload, phase_s: float) -> list[Phase]:
    """Interactive coding at low-to-mid concurrency by day, batch chat at high by night."""
    plan = ((code, 1), (code, 4), (code, 16), (chat, 128), (chat, 64), (chat, 96), (code, 8), (chat, 32))
    return [Phase(phase_s, c, w) for w, c in plan]


def controller_config(cal: Calibration, prior: Sequence[float] = MT_BENCH_ACCEPTANCE, **overrides) -> ControllerConfig:
    cfg = ControllerConfig(
        cost=cal.cost, max_num_speculative_tokens=cal.max_num_speculative_tokens, max_num_seqs=cal.max_num_seqs,
        kv_capacity_tokens=cal.kv_capacity_tokens, acceptance_prior=tuple(prior), target_tpot_s=0.02,
        default_context_tokens_per_req=CONTEXT_TOKENS_PER_REQ)
    return replace(cfg, **overrides)


def policy_lineup(cal: Calibration, prior: Sequence[float] = MT_BENCH_ACCEPTANCE,
                  fixed_ks: Sequence[int] = FIXED_KS) -> list[Callable[[], SpecPolicy]]:
    """Fresh-policy factories. The static table and the controller start from the same
    generic prior (MT-Bench); only the controller learns the workload."""
    kmax, n = cal.max_num_speculative_tokens, cal.max_num_seqs
    out: list[Callable[[], SpecPolicy]] = [lambda k=k: FixedK(k) for k in fixed_ks]
    out.append(lambda: StaticTable.tuned(cal.cost, prior, kmax, n, CONTEXT_TOKENS_PER_REQ))
    out.append(CandidateSets)
    out.append(lambda: ControllerArm(controller_config(cal, prior)))
    return out


def pool_config(cal: Calibration, seed: int = 0, warmup_s: float = 0.0) -> PoolConfig:
    return PoolConfig(cost=cal.cost, max_num_seqs=cal.max_num_seqs, kv_capacity_tokens=cal.kv_capacity_tokens,
                      warmup_s=warmup_s, seed=seed)


def run_sweep(cal: Calibration, workload: Workload, policies: Sequence[Callable[[], SpecPolicy]],
              concurrency: Sequence[int] = SWEEP_CONCURRENCY, duration_s: float = 20.0,
              warmup_s: float = 3.0, seed: int = 0) -> dict[str, dict[int, float]]:
    """tokens/s[policy name][concurrency], one replica, same seed for every policy."""
    out: dict[str, dict[int, float]] = {}
    for make in policies:
        for c in concurrency:
            pol = make()
            r = simulate(pol, [Phase(duration_s, c, workload)], pool_config(cal, seed, warmup_s))
            out.setdefault(pol.name, {})[c] = r.tokens_per_s
    return out


def run_trace(cal: Calibration, phases: Sequence[Phase], policies: Sequence[Callable[[], SpecPolicy]],
              seed: int = 0) -> dict[str, SimResult]:
    out = {}
    for make in policies:
        pol = make()
        out[pol.name] = simulate(pol, phases, pool_config(cal, seed))
    return out


def best_fixed(results: dict[str, float]) -> tuple[str, float]:
    fixed = {k: v for k, v in results.items() if k.startswith("fixed K=")}
    name = max(fixed, key=fixed.get)
    return name, fixed[name]


def model_ceiling(cal: Calibration, phases: Sequence[Phase], fixed_ks: Sequence[int] = FIXED_KS) -> float:
    """Σ_phase duration · max_K goodput / max_fixed-K Σ_phase duration · goodput(K), at B = concurrency."""
    kmax = cal.max_num_speculative_tokens
    rows = [goodput_grid(cal.cost, p.workload.acceptance_per_pos, [p.concurrency], kmax,
                         CONTEXT_TOKENS_PER_REQ)[0] * p.duration_s for p in phases]
    g = np.array(rows)
    return float(g.max(axis=1).sum() / max(g[:, k].sum() for k in fixed_ks))


def worst_case_ceiling(cal: Calibration, workloads: Sequence[Workload], fixed_ks: Sequence[int] = FIXED_KS,
                       concurrency: Sequence[int] = SWEEP_CONCURRENCY, num_mixes: int = 50_000) -> float:
    """The largest model ceiling over random time-mixes of (workload, concurrency) phases:
    roughly the most any trace built from these phases lets a policy gain over fixed K."""
    kmax = cal.max_num_speculative_tokens
    g = np.vstack([goodput_grid(cal.cost, w.acceptance_per_pos, concurrency, kmax, CONTEXT_TOKENS_PER_REQ)
                   for w in workloads])
    mixes = np.random.default_rng(0).dirichlet(np.full(len(g), 0.3), size=num_mixes)
    return float(np.max((mixes @ g.max(axis=1)) / (mixes @ g[:, list(fixed_ks)]).max(axis=1)))
