"""Discrete-event simulator of a pool of speculating replicas.

Owns the simulated world: closed-loop clients whose number follows a trace of phases
(concurrency, workload), a least-loaded router, and per replica continuous batching with
vLLM's shape: each step admits waiting requests while `max_num_seqs`, the prefill token
budget and the KV cache allow (a request holds its context plus the engine's lookahead
slots), runs every running request for one step at the K the policy's schedule gives for
the step's batch size, accepts drafts position by position with the workload's
conditional acceptance p_i / p_{i-1}, and preempts the newest request (recompute) when
growth overflows the KV cache. A step lasts T(B, K) of a `StepCostModel` with
multiplicative noise. Every `control_interval_s` each replica's window (per-position
draft/accept counts, step times by (B, K), queue and KV use) goes to the policy as
`ReplicaSignals`, exactly what the real engine wrapper would report.

Knows nothing about any particular policy (see control.baselines) and nothing about
Ray or vLLM; the replica count is fixed for a run.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from control.model import StepCostModel
from control.policy import ReplicaSignals, StepTimeSample

MAX_SIM_POSITIONS = 16


class SpecPolicy(Protocol):
    name: str
    num_lookahead_tokens: int  # KV slots reserved per request: the engine's start-up K

    def start(self, replica_ids: Sequence[str]) -> None: ...
    def num_speculative_tokens(self, replica_id: str, batch_size: int) -> int: ...
    def on_interval(self, now_s: float, signals: Sequence[ReplicaSignals]) -> str | None: ...


@dataclass(frozen=True)
class Workload:
    name: str
    acceptance_per_pos: tuple[float, ...]  # true unconditional p_i of this traffic
    prompt_tokens: int = 256
    mean_output_tokens: int = 384
    output_tokens_sigma: float = 0.5  # lognormal spread of output lengths


@dataclass(frozen=True)
class Phase:
    duration_s: float
    concurrency: int  # clients, each with one request in flight (think time 0)
    workload: Workload


@dataclass(frozen=True)
class PoolConfig:
    cost: StepCostModel  # the true step cost of every replica
    num_replicas: int = 1
    max_num_seqs: int = 256
    kv_capacity_tokens: int = 2_400_000
    max_num_batched_tokens: int = 8192  # prefill budget per step (at least one request)
    step_time_noise: float = 0.02  # sigma of the lognormal step-time factor
    control_interval_s: float = 0.5
    warmup_s: float = 0.0  # tokens emitted before this are not counted
    seed: int = 0


@dataclass
class SimResult:
    policy: str
    measured_s: float
    num_output_tokens: int
    phase_output_tokens: list[int]
    timeline: list[tuple[float, int, float, int]] = field(default_factory=list)  # t, B, mean K, clients
    reasons: list[tuple[float, str]] = field(default_factory=list)
    num_decode_req_steps: int = 0
    num_decode_tokens_uncapped: int = 0
    num_preemptions: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.measured_s if self.measured_s > 0 else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Mean tokens a decoding request got per step (1 + accepted), before truncation."""
        return self.num_decode_tokens_uncapped / max(1, self.num_decode_req_steps)


class _Replica:
    def __init__(self, rid: str):
        self.id = rid
        self.waiting: deque = deque()  # (workload index, prompt/context tokens, remaining tokens)
        self.remaining = np.zeros(0, np.int64)
        self.context = np.zeros(0, np.int64)
        self.widx = np.zeros(0, np.int64)
        self.busy = False
        self.outcome = None
        self.reset_window()

    def reset_window(self) -> None:
        self.drafts = np.zeros(MAX_SIM_POSITIONS, np.int64)
        self.accepted = np.zeros(MAX_SIM_POSITIONS, np.int64)
        self.samples: dict[tuple[int, int], list[float]] = {}

    def load(self) -> int:
        admitting = len(self.outcome[1]) if self.busy and self.outcome else 0
        return len(self.remaining) + len(self.waiting) + admitting


def simulate(policy: SpecPolicy, phases: Sequence[Phase], pool: PoolConfig) -> SimResult:
    rng = np.random.default_rng(pool.seed)
    workloads = list(dict.fromkeys(p.workload for p in phases))
    cond = np.zeros((len(workloads), MAX_SIM_POSITIONS))
    for w, wl in enumerate(workloads):
        p = np.r_[1.0, np.asarray(wl.acceptance_per_pos[:MAX_SIM_POSITIONS], float)]
        cond[w, : len(p) - 1] = np.divide(p[1:], p[:-1], out=np.zeros(len(p) - 1), where=p[:-1] > 0)
    replicas = [_Replica(f"r{i}") for i in range(pool.num_replicas)]
    policy.start([r.id for r in replicas])
    lookahead = policy.num_lookahead_tokens
    ends = np.cumsum([p.duration_s for p in phases])
    t_end = float(ends[-1])
    res = SimResult(policy.name, max(0.0, t_end - pool.warmup_s), 0, [0] * len(phases))
    events: list = []
    seq = 0

    def push(t, kind, data=None):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    clients = {"n": 0, "phase": 0}

    def new_request(now):
        ph = phases[clients["phase"]]
        out = max(1, int(rng.lognormal(np.log(ph.workload.mean_output_tokens), ph.workload.output_tokens_sigma)))
        rep = min(replicas, key=lambda r: r.load())
        rep.waiting.append((workloads.index(ph.workload), ph.workload.prompt_tokens, out))
        if not rep.busy:
            start_step(rep, now)

    def start_step(rep, now):
        budget, kv_used = pool.max_num_batched_tokens, int(rep.context.sum()) + lookahead * len(rep.context)
        new = []
        while rep.waiting and len(rep.remaining) + len(new) < pool.max_num_seqs:
            w, ctx, rem = rep.waiting[0]
            if (new and ctx > budget) or kv_used + ctx + lookahead + 1 > pool.kv_capacity_tokens:
                break
            rep.waiting.popleft()
            new.append((w, ctx, rem))
            budget -= ctx
            kv_used += ctx + lookahead
        n_dec = len(rep.remaining)
        if n_dec + len(new) == 0:
            rep.busy = False
            return
        k = min(lookahead, max(0, policy.num_speculative_tokens(rep.id, n_dec + len(new)))) if n_dec else 0
        acc = np.zeros(n_dec, np.int64)
        if k and n_dec:
            ok = rng.random((n_dec, k)) < cond[rep.widx][:, :k]
            acc = np.cumprod(ok, axis=1).sum(axis=1)
            rep.drafts[:k] += n_dec
            rep.accepted[:k] += np.bincount(acc, minlength=k + 1)[::-1].cumsum()[::-1][1:k + 1]
        prefill = sum(c for _, c, _ in new)
        ctx_total = float(rep.context.sum())
        dt = pool.cost.step_time_s(n_dec, k, ctx_total, prefill) * float(rng.lognormal(0.0, pool.step_time_noise))
        if n_dec:
            s = rep.samples.setdefault((n_dec, k), [0, 0.0, 0.0, 0.0])
            s[0] += 1; s[1] += dt; s[2] += prefill; s[3] += ctx_total / n_dec
        rep.busy, rep.outcome = True, (acc, new)
        push(now + dt, "step_done", rep)

    def step_done(rep, now):
        acc, new = rep.outcome
        rep.outcome = None
        emitted = np.minimum(1 + acc, rep.remaining)
        res.num_decode_req_steps += len(acc)
        res.num_decode_tokens_uncapped += int(np.sum(1 + acc))
        if new:
            rep.widx = np.r_[rep.widx, [w for w, _, _ in new]]
            rep.context = np.r_[rep.context, [c for _, c, _ in new]]
            rep.remaining = np.r_[rep.remaining, [r for _, _, r in new]]
            emitted = np.r_[emitted, np.ones(len(new), np.int64)]  # prefill emits the first token
        rep.remaining = rep.remaining - emitted
        rep.context = rep.context + emitted
        if now >= pool.warmup_s:
            res.num_output_tokens += int(emitted.sum())
            res.phase_output_tokens[min(int(np.searchsorted(ends, now, side="right")), len(phases) - 1)] += int(emitted.sum())
        while len(rep.context) and int(rep.context.sum()) + lookahead * len(rep.context) > pool.kv_capacity_tokens:
            rep.waiting.appendleft((int(rep.widx[-1]), int(rep.context[-1]), int(rep.remaining[-1])))
            rep.widx, rep.context, rep.remaining = rep.widx[:-1], rep.context[:-1], rep.remaining[:-1]
            res.num_preemptions += 1
        done = rep.remaining <= 0
        n_done = int(done.sum())
        if n_done:
            keep = ~done
            rep.widx, rep.context, rep.remaining = rep.widx[keep], rep.context[keep], rep.remaining[keep]
        for _ in range(n_done):  # rep stays busy: its finished clients' next requests join its next step
            if clients["n"] > phases[clients["phase"]].concurrency:
                clients["n"] -= 1
            else:
                new_request(now)
        start_step(rep, now)

    def tick(now):
        signals = []
        for rep in replicas:
            samples = tuple(StepTimeSample(b, k, int(n), t / n, p / n, c / n)
                            for (b, k), (n, t, p, c) in sorted(rep.samples.items()))
            signals.append(ReplicaSignals(
                replica_id=rep.id, num_running_reqs=len(rep.remaining), num_waiting_reqs=len(rep.waiting),
                kv_cache_usage=float(rep.context.sum() + lookahead * len(rep.context)) / pool.kv_capacity_tokens,
                num_drafts_per_pos=tuple(int(x) for x in rep.drafts),
                num_accepted_per_pos=tuple(int(x) for x in rep.accepted), step_samples=samples,
                mean_context_tokens_per_req=float(np.mean(rep.context)) if len(rep.context) else 0.0))
            n = sum(v[0] for v in rep.samples.values())
            mean_k = sum(v[0] * k for (_, k), v in rep.samples.items()) / n if n else float("nan")
            if rep is replicas[0]:
                res.timeline.append((now, len(rep.remaining), mean_k, clients["n"]))
            rep.reset_window()
        why = policy.on_interval(now, signals)
        if why:
            res.reasons.append((now, why))

    push(0.0, "phase", 0)
    for i in range(1, len(phases)):
        push(float(ends[i - 1]), "phase", i)
    t = pool.control_interval_s
    while t < t_end:
        push(t, "tick")
        t += pool.control_interval_s
    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > t_end:
            break
        if kind == "step_done":
            step_done(data, now)
        elif kind == "tick":
            tick(now)
        else:
            clients["phase"] = data
            for _ in range(max(0, phases[data].concurrency - clients["n"])):
                clients["n"] += 1
                new_request(now)
    return res
