"""Random sampling under speculation keeps the target model's distribution while K changes
from one engine step to the next across all of 0..K_max (the real vLLM engine on CPU, tiny
model, float32, temperature 1, seeded).

vLLM's rejection sampler accepts a draft x with probability min(1, p(x) / q(x)) and else
draws from the normalised residual max(0, p - q), so each token it emits is distributed
as the target's p whatever the drafts were and however many (K) a step verifies, as long
as K is fixed before the step draws. Per-step K is the project's own addition
(`actors.any_k`, `actors.k0_skip`, `actors.live_schedule`), and its tests so far are
greedy (test_live_schedule.py, test_k0_skip.py: the argmax path) or sample at a fixed K
(test_seeded_sampling.py). A sampled request at a switching K goes through the random
path: uniform draws and recovered tokens per request, temperatures spread over each
step's drafts (`actors.cpu_sampling`). Here, for the first NUM_TOKENS
tokens of one prompt, each speculating arm's token frequencies at every position and the
joint ones of the first two and three tokens must match an engine that does not
speculate: a two-sample chi-square per comparison (rare tokens pooled), rejected below
FAMILY_ALPHA after Bonferroni over both arms. Token 1 is sampled at the prefill step,
before any draft; tokens 2 on come out of speculative verification. The same statistic
must reject a sampler whose drafts leak into the output (every draft accepted), so the
test can fail.

How K switches, deterministically:
* P-EAGLE (parallel drafting): `Engine.k0_skip(force_k_cycle=...)` gives every engine
  step the next K of K_CYCLE (each K twice, never the same K twice in a row). That
  test-only setting refuses any drafter but P-EAGLE's.
* EAGLE-3 (sequential drafting): a batch-size -> K table, K = 3B mod 5 for a batch of B
  requests, so a step after one to four requests finished runs another K than the step
  before, and the group sizes (28..32) start the groups at every K.
Samples run in groups that the scheduler admits at one step, in submission order: it is
paused (vLLM's `pause_generation(mode="keep")`) while a group arrives. With every request
seeded, the step sequence, and so every sample and statistic, is the same on every run
(nothing depends on timing).
"""

import asyncio
from collections import Counter

import pytest

from engine_loop import wait_until

pytestmark = pytest.mark.integration

K_MAX = 4
PROMPT = "squares = [i * i for i in range("
NUM_TOKENS = 6
NUM_SAMPLES = 600  # per arm: ~15 s of sampling; the leaking control is rejected at p < 1e-40
GROUP_SIZES = [32, 31, 30, 29, 28]  # with K_BY_BATCH_SIZE: a group of each size starts at another K
K_CYCLE = [4, 1, 0, 3, 2, 0, 4, 2, 1, 3]
K_BY_BATCH_SIZE = [[b, b, 3 * b % 5] for b in range(1, 33)]
MIN_EXPECTED = 5  # per cell of a chi-square table; rarer tokens are pooled
FAMILY_ALPHA = 1e-3
NUM_COMPARISONS = 2 * (NUM_TOKENS + 2)  # two arms x (each position + two joint prefixes)
ALPHA = FAMILY_ALPHA / NUM_COMPARISONS

BASE = ["engine.max_num_seqs=32", "engine.spec.controller=off"]  # the test sets K
PEAGLE = [*BASE, f"engine.spec.num_speculative_tokens={K_MAX}", f"engine.spec.schedule=[[1,32,{K_MAX}]]"]
EAGLE3 = [*BASE, f"engine.spec.num_speculative_tokens={K_MAX}", f"engine.spec.schedule={K_BY_BATCH_SIZE}",
          "engine.spec.method=eagle3", "engine.spec.head=artifacts/tiny/eagle3-head"]
ALL_ACCEPTED = [*PEAGLE, f"engine.spec.synthetic_acceptance_rates={[1.0] * K_MAX}"]


def chi_square(a: Counter, b: Counter) -> tuple[float, int, float]:
    """Two-sample chi-square test that `a` and `b` (counts per outcome) come from one
    distribution: (statistic, degrees of freedom, p-value). Outcomes expected fewer than
    MIN_EXPECTED times in either sample share one bin (folded into the smallest other bin
    when that bin alone would be too small)."""
    import torch

    n, m = sum(a.values()), sum(b.values())
    share = min(n, m) / (n + m)
    bins = [[a[x], b[x]] for x in sorted(set(a) | set(b)) if (a[x] + b[x]) * share >= MIN_EXPECTED]
    rest = [n - sum(c[0] for c in bins), m - sum(c[1] for c in bins)]
    if sum(rest) * share >= MIN_EXPECTED or not bins:
        bins.append(rest)
    else:
        smallest = min(bins, key=sum)
        smallest[0], smallest[1] = smallest[0] + rest[0], smallest[1] + rest[1]
    if len(bins) < 2:
        return 0.0, 0, 1.0
    statistic = 0.0
    for count_a, count_b in bins:
        for observed, size in ((count_a, n), (count_b, m)):
            expected = (count_a + count_b) * size / (n + m)
            statistic += (observed - expected) ** 2 / expected
    df = len(bins) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, df, p


def compare(reference: list[tuple], samples: list[tuple]) -> dict[str, tuple[float, int, float]]:
    """chi_square per output position (1-based) and for the first two and three tokens."""
    out = {}
    for pos in range(NUM_TOKENS):
        out[f"token {pos + 1}"] = chi_square(Counter(s[pos] for s in reference), Counter(s[pos] for s in samples))
    for length in (2, 3):
        out[f"tokens 1-{length}"] = chi_square(Counter(s[:length] for s in reference),
                                                Counter(s[:length] for s in samples))
    return out


def _report(name: str, tests: dict[str, tuple[float, int, float]]) -> str:
    return f"{name}: " + "; ".join(f"{what} chi2={s:.2f} df={df} p={p:.3g}" for what, (s, df, p) in tests.items())


def _groups(first_seed: int) -> list[list[dict]]:
    rows = [{"id": f"s{seed}", "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 1.0, "seed": seed,
             "ignore_eos": True} for seed in range(first_seed, first_seed + NUM_SAMPLES)]
    groups, i = [], 0
    while i < len(rows):
        size = GROUP_SIZES[len(groups) % len(GROUP_SIZES)]
        groups.append(rows[i:i + size])
        i += size
    return groups



async def _generate_group(engine, rows: list[dict]) -> list[dict]:
    """Generate `rows` admitted at one scheduler step, in order: the scheduler is paused
    until the engine core holds them all (their adds precede the resume on one socket).
    vLLM's own pause: the `Engine` wrapper has none, only this test needs one."""
    llm = engine._llm
    await llm.pause_generation(mode="keep", clear_cache=False)
    tasks = []
    try:
        for row in rows:
            tasks.append(asyncio.ensure_future(engine.generate(row)))
            await wait_until(lambda: llm.get_num_unfinished_requests() == len(tasks) or tasks[-1].done(),
                              f"request {row['id']} to reach the engine")
    finally:
        await llm.resume_generation()
    return list(await asyncio.gather(*tasks))


def _sample(loop, overrides: list[str], first_seed: int, k_cycle: list[int] | None = None):
    """NUM_SAMPLES seeded samples (token tuples, in seed order), the engine's step window
    and, under a forced K cycle, its K=0 skip counters."""
    engine = loop.start_engine(overrides)
    try:
        if k_cycle is not None:
            loop.run(engine.k0_skip({"reset": True, "force_k_cycle": k_cycle}))
        engine.step_window.drain()

        async def run():
            return [r for rows in _groups(first_seed) for r in await _generate_group(engine, rows)]

        results = loop.run(run(), timeout=600)
        window = engine.step_window.drain()
        counters = loop.run(engine.k0_skip()) if k_cycle is not None else None
    finally:
        engine.shutdown()
    assert all(r["ok"] and len(r["token_ids"]) == NUM_TOKENS for r in results), \
        [r.get("error") for r in results if not r["ok"]][:3]
    return [tuple(r["token_ids"]) for r in results], window, counters


@pytest.fixture(scope="module")
def reference(tiny_models, loop):
    samples, window, _ = _sample(loop, [*BASE, "engine.spec={method: none}"], first_seed=0)
    assert not any(window["drafts_per_pos"]), window
    return samples


def _assert_speculated_at_every_k(window: dict) -> None:
    """Every K in 0..K_MAX ran, and drafts reached (and were accepted at) every position."""
    assert set(window["num_steps_by_k"]) == set(range(K_MAX + 1)), window["num_steps_by_k"]
    assert all(n >= 10 for n in window["num_steps_by_k"].values()), window["num_steps_by_k"]  # ~15 each
    drafts, accepted = window["drafts_per_pos"], window["accepted_per_pos"]
    assert len(drafts) == K_MAX and all(drafts) and accepted[0] > 0.1 * drafts[0], (drafts, accepted)


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_sampling_with_k_switching_every_step_keeps_the_target_distribution(method, reference, loop):
    if method == "peagle":
        samples, window, counters = _sample(loop, PEAGLE, first_seed=NUM_SAMPLES, k_cycle=K_CYCLE)
        assert counters["skipped_steps"] > 0 and counters["catchup_passes"] > 0, counters  # K=0 steps skipped the head
    else:
        samples, window, _ = _sample(loop, EAGLE3, first_seed=2 * NUM_SAMPLES)
    _assert_speculated_at_every_k(window)
    tests = compare(reference, samples)
    print(_report(method, tests), f"steps by K {window['num_steps_by_k']}",
          f"drafts {window['drafts_per_pos']} accepted {window['accepted_per_pos']}")
    assert all(df >= 3 for _, df, _ in tests.values()), tests  # every comparison has bins to compare
    rejected = {what: t for what, t in tests.items() if t[2] < ALPHA}
    assert not rejected, f"{method}: sampled tokens differ from the target's distribution (p < {ALPHA:.2g}): {rejected}"


def test_the_statistic_rejects_drafts_leaking_into_the_output(reference, loop):
    """P-EAGLE with every draft accepted (synthetic acceptance 1.0) under the same K cycle:
    positions 2 on then hold the head's greedy drafts wherever a step drafted, which is
    not the target's distribution. The first token, sampled before any draft, still is."""
    samples, window, _ = _sample(loop, ALL_ACCEPTED, first_seed=3 * NUM_SAMPLES, k_cycle=K_CYCLE)
    assert window["accepted_per_pos"] == window["drafts_per_pos"] and all(window["drafts_per_pos"]), window
    tests = compare(reference, samples)
    print(_report("all drafts accepted", tests))
    assert tests["token 1"][2] >= ALPHA, tests["token 1"]
    assert all(tests[f"token {pos}"][2] < ALPHA for pos in range(2, NUM_TOKENS + 1)), tests
