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

Knows nothing about any particular policy (see benchmarks.sim.policies) and nothing about
Ray or vLLM; the replica count is fixed for a run.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from collections import deque
from functools import lru_cache
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


#: Drafts (requests x K) up to which a step's acceptance is drawn in plain Python; above
#: it, numpy's per-call overhead is the smaller cost. Either way the same random numbers.
MAX_PYTHON_DRAFTS = 128


class _Replica:
    """One engine: its running requests as parallel lists in admission order (preemption
    takes the newest), its waiting queue, and the window the next tick reports.

    Laid out so that a step costs as little as possible, which is what bounds the
    simulator's speed. Lists, not arrays: most steps run a few requests, where numpy's
    per-call overhead is most of the cost. Every decoding request emits one token per
    step plus its accepted drafts, so `marks` holds remaining tokens + `num_steps` (a step
    counts the one token by incrementing `num_steps` and changes a mark only by accepted
    drafts; a request is done once its mark is down to `num_steps`), and `totals` holds
    context + remaining, which emitting does not change. The running requests' total
    context (`context_tokens`) and the lowest mark (`min_mark`) are kept as ints:
    admission, the step time and preemption read the one, and the other says without a
    pass over the requests whether one has finished."""

    def __init__(self, rid: str):
        self.id = rid
        self.waiting: deque = deque()  # (workload index, prompt/context tokens, remaining tokens)
        self.widx: list[int] = []
        self.marks: list[int] = []
        self.totals: list[int] = []
        self.num_steps = 0
        self.context_tokens = 0
        self.min_mark = 0
        self.done: list[int] = []  # indices the last step finished, ascending
        self.cond_rows: np.ndarray | None = None  # conditional acceptance per running request
        self.busy = False
        self.outcome = None
        self.reset_window()

    def reset_window(self) -> None:
        # Tallied per position at the tick: drafts as request-steps by K (a step at K drafts
        # positions 1..K once per request), acceptance as every request-step's accepted drafts.
        self.req_steps_by_k = [0] * (MAX_SIM_POSITIONS + 1)
        self.accepted_runs: list[int] = []
        self.samples: dict[tuple[int, int], list[float]] = {}

    def window_per_pos(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(drafts, accepted) per position: position i counts the request-steps run at
        K >= i, and those that accepted at least i drafts."""
        accepted = np.bincount(np.array(self.accepted_runs, np.int64), minlength=MAX_SIM_POSITIONS + 1)
        return _at_least_each(self.req_steps_by_k), _at_least_each(accepted)

    def load(self) -> int:
        admitting = len(self.outcome[1]) if self.busy and self.outcome else 0
        return len(self.marks) + len(self.waiting) + admitting

    def admit(self, pool: PoolConfig, lookahead: int) -> list[tuple[int, int, int]]:
        """Waiting requests this step prefills, in order, while `max_num_seqs`, the prefill
        budget (at least one request) and the KV cache (context + lookahead each) allow."""
        if not self.waiting:
            return []
        budget, kv_used = pool.max_num_batched_tokens, self.context_tokens + lookahead * len(self.marks)
        new: list[tuple[int, int, int]] = []
        room = pool.max_num_seqs - len(self.marks)
        while self.waiting and len(new) < room:
            _, ctx, _ = self.waiting[0]
            if (new and ctx > budget) or kv_used + ctx + lookahead + 1 > pool.kv_capacity_tokens:
                break
            new.append(self.waiting.popleft())
            budget -= ctx
            kv_used += ctx + lookahead
        return new

    def advance(self, accepted: list[int] | None, new: list[tuple[int, int, int]]) -> tuple[int, int]:
        """Apply a finished step: decoding requests emit 1 + accepted drafts (`accepted`
        None: nobody drafted), at most what they have left; admitted ones join and emit
        their first token. Notes which requests are done (for `finish`). Returns (tokens
        emitted, decoders' tokens before truncation)."""
        emitted = uncapped = len(self.marks)
        if uncapped:
            self.num_steps += 1
        steps = self.num_steps
        if accepted is not None:
            self.marks = list(map(operator.sub, self.marks, accepted))
            uncapped += sum(accepted)
            emitted = uncapped
            self.min_mark = min(self.marks)
        self.done = []
        if self.marks and self.min_mark <= steps:
            self.done = [i for i, m in enumerate(self.marks) if m <= steps]
            for i in self.done:  # one that accepted past its last token emitted only what was left
                emitted -= steps - self.marks[i]
                self.marks[i] = steps
            self.min_mark = steps
        if new:
            marks = [r - 1 + steps for _, _, r in new]
            self.min_mark = min(self.min_mark, *marks) if self.marks else min(marks)
            self.done += [len(self.marks) + i for i, m in enumerate(marks) if m <= steps]
            self.marks += marks
            self.totals += [c + r for _, c, r in new]
            self.widx += [w for w, _, _ in new]
            self.cond_rows = None
            self.context_tokens += sum(c for _, c, _ in new)
            emitted += len(new)
        self.context_tokens += emitted
        return emitted, uncapped

    def preempt_newest(self) -> None:
        """Back to the front of the queue with what it has (recompute on readmission)."""
        remaining = self.marks.pop() - self.num_steps
        context = self.totals.pop() - remaining
        self.waiting.appendleft((self.widx.pop(), context, remaining))
        self.context_tokens -= context
        if self.done and self.done[-1] == len(self.marks):
            self.done.pop()
        self.min_mark = min(self.marks, default=0)
        self.cond_rows = None

    def finish(self) -> int:
        """Drop the requests the last step finished; returns how many."""
        for i in reversed(self.done):
            self.context_tokens -= self.totals[i] - self.marks[i] + self.num_steps
            del self.marks[i], self.totals[i], self.widx[i]
        if self.done:
            self.min_mark = min(self.marks, default=0)
            self.cond_rows = None
        return len(self.done)


def _at_least_each(counts) -> tuple[int, ...]:
    """Entries with index >= i, for i = 1..MAX_SIM_POSITIONS, from counts by index 0..MAX."""
    return tuple(int(x) for x in np.cumsum(np.asarray(counts)[::-1])[::-1][1:])


def _step_time_fn(cost: StepCostModel):
    """`cost.step_time_s`, memoized by (B, K, prefill) where the KV term is zero (context
    then changes nothing, exactly: the term adds 0.0): the simulator asks once per step."""
    if cost.per_kv_token_s:
        return cost.step_time_s
    cached = lru_cache(maxsize=None)(lambda b, k, prefill: cost.step_time_s(b, k, 0.0, prefill))
    return lambda b, k, ctx, prefill: cached(b, k, prefill)


def simulate(policy: SpecPolicy, phases: Sequence[Phase], pool: PoolConfig) -> SimResult:
    rng = np.random.default_rng(pool.seed)
    workloads = list(dict.fromkeys(p.workload for p in phases))
    cond = np.zeros((len(workloads), MAX_SIM_POSITIONS))
    for w, wl in enumerate(workloads):
        p = np.r_[1.0, np.asarray(wl.acceptance_per_pos[:MAX_SIM_POSITIONS], float)]
        cond[w, : len(p) - 1] = np.divide(p[1:], p[:-1], out=np.zeros(len(p) - 1), where=p[:-1] > 0)
    cond_lists = cond.tolist()
    phase_widx = [workloads.index(p.workload) for p in phases]
    log_mean_output = [np.log(p.workload.mean_output_tokens) for p in phases]
    replicas = [_Replica(f"r{i}") for i in range(pool.num_replicas)]
    policy.start([r.id for r in replicas])
    lookahead = policy.num_lookahead_tokens
    ends = [float(e) for e in np.cumsum([p.duration_s for p in phases])]
    t_end = ends[-1]
    res = SimResult(policy.name, max(0.0, t_end - pool.warmup_s), 0, [0] * len(phases))
    events: list = []
    seq = itertools.count()
    # Bound once: these run every simulated step.
    random, lognormal, step_time_s = rng.random, rng.lognormal, _step_time_fn(pool.cost)
    num_speculative_tokens = policy.num_speculative_tokens

    def push(t, kind, data=None):
        heapq.heappush(events, (t, next(seq), kind, data))

    clients = {"n": 0, "phase": 0}

    def new_request(now):
        i = clients["phase"]
        out = max(1, int(lognormal(log_mean_output[i], phases[i].workload.output_tokens_sigma)))
        rep = min(replicas, key=_Replica.load)
        rep.waiting.append((phase_widx[i], phases[i].workload.prompt_tokens, out))
        if not rep.busy:
            start_step(rep, now)

    def draw_accepted(rep, n_dec, k):
        """Drafts each running request accepts: drafts 1..j while each passes with
        p_j / p_{j-1}, from n_dec x k uniforms (row-major: the same numbers both ways)."""
        if n_dec * k > MAX_PYTHON_DRAFTS:
            if len(workloads) == 1:
                rows = cond[0]
            elif rep.cond_rows is None:
                rows = rep.cond_rows = cond[rep.widx]
            else:
                rows = rep.cond_rows
            passed = np.logical_and.accumulate(random((n_dec, k)) < rows[..., :k], axis=1)
            return np.add.reduce(passed, axis=1).tolist()
        accepted = []
        for u, w in zip(random((n_dec, k)).tolist(), rep.widx):
            c, j = cond_lists[w], 0
            while j < k and u[j] < c[j]:
                j += 1
            accepted.append(j)
        return accepted

    def start_step(rep, now):
        new = rep.admit(pool, lookahead)
        n_dec = len(rep.marks)
        if n_dec + len(new) == 0:
            rep.busy = False
            return
        k = min(lookahead, max(0, num_speculative_tokens(rep.id, n_dec + len(new)))) if n_dec else 0
        accepted = None
        if k:
            accepted = draw_accepted(rep, n_dec, k)
            rep.req_steps_by_k[k] += n_dec
            rep.accepted_runs += accepted
        prefill = sum(c for _, c, _ in new) if new else 0
        ctx_total = float(rep.context_tokens)
        dt = step_time_s(n_dec, k, ctx_total, prefill) * lognormal(0.0, pool.step_time_noise)
        if n_dec:
            s = rep.samples.get((n_dec, k))
            if s is None:
                s = rep.samples[n_dec, k] = [0, 0.0, 0.0, 0.0]
            s[0] += 1; s[1] += dt; s[2] += prefill; s[3] += ctx_total / n_dec
        rep.busy, rep.outcome = True, (accepted, new)
        push(now + dt, "step_done", rep)

    def step_done(rep, now):
        accepted, new = rep.outcome
        rep.outcome = None
        res.num_decode_req_steps += len(rep.marks)
        emitted, uncapped = rep.advance(accepted, new)
        res.num_decode_tokens_uncapped += uncapped
        if now >= pool.warmup_s:
            res.num_output_tokens += emitted
            res.phase_output_tokens[min(bisect.bisect_right(ends, now), len(phases) - 1)] += emitted
        while rep.marks and rep.context_tokens + lookahead * len(rep.marks) > pool.kv_capacity_tokens:
            rep.preempt_newest()
            res.num_preemptions += 1
        for _ in range(rep.finish()):  # rep stays busy: its finished clients' next requests join its next step
            if clients["n"] > phases[clients["phase"]].concurrency:
                clients["n"] -= 1
            else:
                new_request(now)
        start_step(rep, now)

    def tick(now):
        signals = []
        for rep in replicas:
            n_run = len(rep.marks)
            samples = tuple(StepTimeSample(b, k, int(n), t / n, p / n, c / n)
                            for (b, k), (n, t, p, c) in sorted(rep.samples.items()))
            drafts, accepted = rep.window_per_pos()
            signals.append(ReplicaSignals(
                replica_id=rep.id, num_running_reqs=n_run, num_waiting_reqs=len(rep.waiting),
                kv_cache_usage=float(rep.context_tokens + lookahead * n_run) / pool.kv_capacity_tokens,
                num_drafts_per_pos=drafts, num_accepted_per_pos=accepted, step_samples=samples,
                mean_context_tokens_per_req=rep.context_tokens / n_run if n_run else 0.0))
            n = sum(v[0] for v in rep.samples.values())
            mean_k = sum(v[0] * k for (_, k), v in rep.samples.items()) / n if n else float("nan")
            if rep is replicas[0]:
                res.timeline.append((now, n_run, mean_k, clients["n"]))
            rep.reset_window()
        why = policy.on_interval(now, signals)
        if why:
            res.reasons.append((now, why))

    push(0.0, "phase", 0)
    for i in range(1, len(phases)):
        push(ends[i - 1], "phase", i)
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
