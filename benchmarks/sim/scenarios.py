"""The standard comparison: workloads, traces, the policy line-up, and how to run them.

Owns the experiment the benchmark prints and the tests check on a reduced size: a
concurrency sweep (one replica, closed loop, one workload) and a suite of time-varying
traces (load only, day/night workload shift, and the worst-case mixes of phases for code,
chat and code+chat), each policy run on the same seed, plus two yardsticks per trace:
- the model ceiling: the goodput of the best K per phase (from the same model, at
  B = concurrency) over the best single fixed K; no policy can gain more;
- the simulated oracle (`phase_oracle`): every fixed K in 0..K_max simulated over the
  trace, the best of them per phase, transients included. A controller's share of the
  oracle's gain over the best fixed K is what it kept of what was there to win.

Knows nothing about printing or plotting (benchmarks/controller_sim.py does that).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from benchmarks.sim.policies import CandidateSets, ControllerArm, FixedK, StaticTable
from benchmarks.sim.simulator import Phase, PoolConfig, SimResult, SpecPolicy, Workload, simulate
from control.acceptance import prior_estimate
from control.calibration import Calibration
from tools.fit_calibration import MT_BENCH_ACCEPTANCE
from control.model import goodput_grid
from control.policy import ControllerConfig

FIXED_KS = (0, 3, 7, 11)
SWEEP_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
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


def _worst_mix(cal: Calibration, workloads: Sequence[Workload], fixed_ks: Sequence[int],
               concurrency: Sequence[int], num_mixes: int) -> tuple[float, np.ndarray, list[tuple[Workload, int]]]:
    """(ceiling, weights, cells) of the random time-mix of (workload, concurrency) cells
    with the largest model ceiling."""
    kmax = cal.max_num_speculative_tokens
    g = np.vstack([goodput_grid(cal.cost, w.acceptance_per_pos, concurrency, kmax, CONTEXT_TOKENS_PER_REQ)
                   for w in workloads])
    cells = [(w, c) for w in workloads for c in concurrency]
    mixes = np.random.default_rng(0).dirichlet(np.full(len(g), 0.3), size=num_mixes)
    ceilings = (mixes @ g.max(axis=1)) / (mixes @ g[:, list(fixed_ks)]).max(axis=1)
    i = int(np.argmax(ceilings))
    return float(ceilings[i]), mixes[i], cells


def worst_case_ceiling(cal: Calibration, workloads: Sequence[Workload], fixed_ks: Sequence[int] = FIXED_KS,
                       concurrency: Sequence[int] = SWEEP_CONCURRENCY, num_mixes: int = 50_000) -> float:
    """The largest model ceiling over random time-mixes of (workload, concurrency) phases:
    roughly the most any trace built from these phases lets a policy gain over fixed K."""
    return _worst_mix(cal, workloads, fixed_ks, concurrency, num_mixes)[0]


def worst_case_trace(cal: Calibration, workloads: Sequence[Workload], total_s: float, min_share: float = 0.04,
                     concurrency: Sequence[int] | None = None, num_mixes: int = 20_000) -> list[Phase]:
    """The worst-case mix (`worst_case_ceiling`) played as a trace: each cell with at least
    `min_share` of the time becomes one phase lasting its share of `total_s` (shares
    renormalized), in a fixed shuffled order: concurrency jumps both ways."""
    cs = concurrency or tuple(c for c in SWEEP_CONCURRENCY if c <= cal.max_num_seqs)
    _, weights, cells = _worst_mix(cal, workloads, FIXED_KS, cs, num_mixes)
    keep = [i for i in np.argsort(-weights) if weights[i] >= min_share]
    order = [int(i) for i in np.random.default_rng(1).permutation(keep)]
    share = weights[order] / weights[order].sum()
    return [Phase(float(total_s * f), cells[i][1], cells[i][0]) for i, f in zip(order, share)]


def trace_suite(cal: Calibration, phase_s: float) -> dict[str, list[Phase]]:
    """The traces the controller is judged on (see the module docstring)."""
    code, chat = code_workload(cal), chat_workload(cal.max_num_speculative_tokens)
    total = 10 * phase_s
    return {
        "load only (code)": load_trace(code, phase_s),
        "day code / night chat": day_night_trace(code, chat, phase_s),
        "worst-case mix (code)": worst_case_trace(cal, [code], total),
        "worst-case mix (chat)": worst_case_trace(cal, [chat], total),
        "worst-case mix (code+chat)": worst_case_trace(cal, [code, chat], total),
    }


@dataclass(frozen=True)
class Oracle:
    """Every fixed K simulated over one trace; the oracle takes the best K in each phase."""

    tokens_per_s_by_k: tuple[float, ...]  # whole trace, fixed K = index
    best_k_by_phase: tuple[int, ...]
    tokens_per_s: float  # the oracle's

    @property
    def best_fixed_k(self) -> int:
        return int(np.argmax(self.tokens_per_s_by_k))

    @property
    def best_fixed_tokens_per_s(self) -> float:
        return max(self.tokens_per_s_by_k)

    def share_of_gain(self, tokens_per_s: float) -> float:
        """(policy - best fixed K) / (oracle - best fixed K); 1.0 where there is no gain to win."""
        room = self.tokens_per_s - self.best_fixed_tokens_per_s
        return (tokens_per_s - self.best_fixed_tokens_per_s) / room if room > 0 else 1.0


def phase_oracle(cal: Calibration, phases: Sequence[Phase], seed: int = 0,
                 selection_seeds: Sequence[int] = (101, 102)) -> Oracle:
    """The best fixed K per phase, chosen on other seeds than the one it is scored on: a
    maximum over a dozen noisy per-phase results would be biased upward (near-equal Ks
    differ by sampling noise alone) and overstate what there was to win."""
    def per_phase_tokens(s: int) -> tuple[np.ndarray, list[SimResult]]:
        runs = [simulate(FixedK(k), phases, pool_config(cal, s)) for k in range(cal.max_num_speculative_tokens + 1)]
        return np.array([r.phase_output_tokens for r in runs], float), runs  # [K, phase]

    chosen = np.argmax(sum(per_phase_tokens(s)[0] for s in selection_seeds), axis=0)
    tokens, runs = per_phase_tokens(seed)
    measured_s = runs[0].measured_s
    return Oracle(tokens_per_s_by_k=tuple(float(r.tokens_per_s) for r in runs),
                  best_k_by_phase=tuple(int(k) for k in chosen),
                  tokens_per_s=float(tokens[chosen, np.arange(len(phases))].sum() / measured_s))
