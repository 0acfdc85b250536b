"""A P-EAGLE K=0 step skips the head, and the head's KV cache catches up when drafting
resumes (`actors.k0_skip`; the real vLLM engine on CPU, tiny model, float32, greedy).

K is forced per step from a cycle (`force_k_cycle`, a test-only engine-core setting), so
which steps skip is deterministic. Outputs must equal no speculation token for token;
K=0 steps, prompts joining included, must run the head zero times; and acceptance with
long K=0 spells (prompts joining in them) must equal acceptance at K=4 throughout, which
only holds if catch-up rebuilt the draft KV cache exactly (with catch-up off, the same run
accepts clearly less). Acceptance is checked draft by draft against the known greedy
sequence at the points both runs drafted, so which steps a request happens to share does
not move it. A request that ends inside a K=0 spell must not leave its un-drafted blocks
in the prefix cache for a later request to draft over.
"""

import pytest

from actors.k0_skip import KEEP_AFTER_STEPS
from engine_loop import generate_all
from humaneval_inputs import humaneval_requests
from configs import load_config

pytestmark = pytest.mark.integration

K_MAX = 4
PROMPTS = [{"id": r["id"], "prompt": r["prompt"], "max_tokens": 8 + 8 * i}
           for i, r in enumerate(humaneval_requests(limit=12))]
BASE = ["sampling.temperature=0", "engine.max_num_seqs=32", "engine.spec.controller=off"]  # the test sets K
PEAGLE = [*BASE, f"engine.spec.num_speculative_tokens={K_MAX}", f"engine.spec.schedule=[[1,32,{K_MAX}]]"]
SWITCHING = [4, 2, 0, 0, 3, 1, 0, 4, 0, 0, 0, 2]
SPELLS = [0, 0, 0, 0, 0, 0, 0, 0, 4]  # eight skipped steps (the prompts join on the first), one drafting


@pytest.fixture(scope="module")
def reference(tiny_models, loop):
    engine = loop.start_engine([*BASE, "engine.spec={method: none}"])
    try:
        return loop.run(generate_all(engine, PROMPTS))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def sequences(reference, tiny_models, loop):
    """Each prompt's whole greedy sequence (prompt tokens, then the output), by the key the
    engine records drafts under: what every draft is checked against."""
    from transformers import AutoTokenizer

    cfg = load_config("tiny", BASE)
    tokenizer = AutoTokenizer.from_pretrained(cfg.engine.model)
    whole = {}
    for p in PROMPTS:
        prompt_ids = tokenizer.encode(p["prompt"])  # as the engine tokenizes a raw prompt
        whole[hash(tuple(prompt_ids))] = prompt_ids + reference[p["id"]]
    return whole


@pytest.fixture(scope="module")
def peagle(tiny_models, loop):
    engine = loop.start_engine(PEAGLE)
    yield engine
    engine.shutdown()


def _run(engine, loop, cycle, prompts=PROMPTS, **settings):
    """Generate under a forced K cycle; return (outputs, step window, skip counters); the
    counters' "drafts" map (prompt, position) to the drafts made there."""
    loop.run(engine.k0_skip({"reset": True, "force_k_cycle": cycle, "record_drafts": True, **settings}))
    engine.step_window.drain()
    restore = {"force_k_cycle": None, "catch_up": True, "record_drafts": False, "skip_prompts": True,
               "evict_holes": True, "keep_after_steps": KEEP_AFTER_STEPS}
    if "skip" in settings:
        restore["skip"] = True
    if "stash_tokens" in settings:
        restore["stash_tokens"] = 0  # back to the width the memory budget gives
    try:
        out = loop.run(generate_all(engine, prompts))
        counters = loop.run(engine.k0_skip())
    finally:
        recorded = loop.run(engine.k0_skip(restore))["drafts"]
    counters["drafts"] = {(h, pos): tuple(d) for h, pos, d in recorded}
    return out, engine.step_window.drain(), counters


def _same_drafts(run: dict, reference: dict) -> tuple[float, int]:
    """Share of `run`'s drafting points where the first draft equals the reference's
    (as many drafts as both made), and how many points both have."""
    common = [key for key in run if key in reference]
    same = sum(run[key][:len(reference[key])] == reference[key][:len(run[key])] for key in common)
    return same / max(1, len(common)), len(common)


def _accepted(drafts: dict, sequences: dict) -> dict:
    """Per drafting point, how many of its drafts the greedy sequence confirms in a row (a
    draft at position `pos` proposes the token at `pos`): acceptance that no scheduling
    changes, since it is checked against the known answer rather than counted per step."""
    accepted = {}
    for (h, pos), draft in drafts.items():
        seq = sequences[h]
        n = 0
        while n < len(draft) and pos + n < len(seq) and draft[n] == seq[pos + n]:
            n += 1
        accepted[(h, pos)] = n
    return accepted


def _acceptance(window: dict) -> list[float]:
    return [a / d for a, d in zip(window["accepted_per_pos"], window["drafts_per_pos"]) if d]


def test_switching_through_k0_is_lossless_and_skips_the_head(reference, peagle, loop):
    out, window, counters = _run(peagle, loop, SWITCHING)
    assert not [i for i in reference if out[i] != reference[i]]
    assert counters["enabled"], counters
    assert counters["skipped_steps"] > 0 and counters["catchup_passes"] > 0, counters
    assert counters["plain_sampled_steps"] > 0, counters  # steps after a K=0 one verified nothing
    drafts = window["drafts_per_pos"]
    assert len(drafts) >= K_MAX and all(drafts[:K_MAX]), drafts  # every K > 0 ran too


def test_k0_steps_run_the_head_zero_times_prompts_included(peagle, loop):
    # K=0 for good: every step skips, the prompts' too; no catch-up (drafting never resumes).
    prompts = [{**p, "max_tokens": 24} for p in PROMPTS[:6]]
    _, _, counters = _run(peagle, loop, [0], prompts, keep_after_steps=0)  # a spell that has lasted
    assert counters["skip_prompts"], counters
    assert counters["skipped_steps"] >= 20, counters
    assert counters["head_forwards"] == 0 and counters["catchup_passes"] == 0, counters
    assert counters["stashed_prompt_tokens"] >= 6 * 32, counters  # every prompt, each several blocks long
    # and nothing to verify on those steps: each sampled as a plain engine's, not through
    # the rejection sampler
    assert counters["plain_sampled_steps"] >= counters["skipped_steps"], counters
    # Every request ended inside the spell, and its blocks stay in the prefix cache while K=0
    # holds (a hit there costs nothing): the K=0 engine keeps a plain engine's prefix hits.
    assert counters["evicted_blocks"] == 0 and counters["kept_holes"] >= 6, counters
    kept = counters["kept_holes"]  # they leave before the next run's first step
    # With prompts not skipped (as a speculating engine did before), the head runs for the
    # steps the prompts join on only, at most one per request. Here the spell is shorter than
    # keep_after_steps (6 x 24 tokens take fewer steps however they are batched): the
    # requests' gaps leave the cache as they end.
    _, _, counters = _run(peagle, loop, [0], prompts, skip_prompts=False, keep_after_steps=1000)
    assert counters["stashed_prompt_tokens"] == 0 and counters["skipped_steps"] >= 20, counters
    assert 1 <= counters["head_forwards"] == counters["k0_head_runs"] <= 6, counters
    assert counters["skipped_steps"] < counters["keep_after_steps"], counters
    assert counters["kept_holes"] == 0 and counters["evicted_blocks"] >= kept + 6, (kept, counters)


def test_catch_up_makes_acceptance_after_a_gap_equal_acceptance_without_one(reference, sequences, peagle, loop):
    _, continuous, a_run = _run(peagle, loop, [K_MAX])
    # Drafting every step reaches only the positions its accepted tokens land on; K=1
    # throughout fills most others in (its one draft is the first of a K=4 pass's).
    drafted_every_step = {**_run(peagle, loop, [1])[2]["drafts"], **a_run["drafts"]}
    out, gapped, b_run = _run(peagle, loop, SPELLS)
    assert not [i for i in reference if out[i] != reference[i]]
    assert b_run["enabled"] and b_run["skipped_steps"] > 0 and b_run["catchup_tokens"] > 0, b_run
    assert b_run["stashed_prompt_tokens"] > 0, b_run  # prompts joined in the spells and were caught up too
    _, stale, c_run = _run(peagle, loop, SPELLS, catch_up=False)
    assert c_run["catchup_passes"] == 0 and c_run["skipped_steps"] > 0, c_run
    # Exact: wherever the gapped run drafted, the run drafting every step drafted the same.
    same_b, n_b = _same_drafts(b_run["drafts"], drafted_every_step)
    same_c, n_c = _same_drafts(c_run["drafts"], drafted_every_step)
    assert n_b >= 20 and n_c >= 20, (n_b, n_c)  # measured 42 and 43 of ~60
    assert same_b >= 0.97, (same_b, n_b)
    assert same_c <= same_b - 0.2, (same_b, same_c)  # stale draft KV: the negative control
    # Acceptance, checked against the known greedy sequence at the points both this run and
    # K=4 throughout drafted (same contexts, whatever the scheduling): a gap costs nothing,
    # while no catch-up costs clearly.
    k4 = _accepted(a_run["drafts"], sequences)
    (m_b, b_k4, b), (m_c, c_k4, c) = (_paired_length(run, k4, sequences) for run in (b_run, c_run))
    print(f"drafts equal to K=4 throughout: caught up {same_b:.3f} of {n_b}, no catch-up {same_c:.3f} of {n_c}; "
          f"accepted per drafting point, paired with K=4 throughout: caught up {b:.2f} vs {b_k4:.2f} at {m_b} "
          f"points, no catch-up {c:.2f} vs {c_k4:.2f} at {m_c}; per position (steps) K=4 throughout "
          f"{_acceptance(continuous)}, caught up {_acceptance(gapped)}, no catch-up {_acceptance(stale)}")
    assert m_b >= 15 and m_c >= 15, (m_b, m_c)  # measured 30 and 37-44
    assert b >= 0.95 * b_k4, (b, b_k4)  # measured equal
    assert c <= 0.85 * c_k4, (c, c_k4)  # measured 0.52-0.73 of it


def _paired_length(run: dict, k4: dict, sequences: dict) -> tuple[int, float, float]:
    """At the drafting points `run` shares with K=4 throughout: how many, and the mean
    accepted length of K=4 throughout and of `run` there."""
    mine = _accepted(run["drafts"], sequences)
    points = [key for key in mine if key in k4]
    n = max(1, len(points))
    return len(points), sum(k4[key] for key in points) / n, sum(mine[key] for key in points) / n


def test_a_gap_longer_than_the_stash_is_flushed_and_stays_exact(reference, peagle, loop):
    out, window, counters = _run(peagle, loop, [K_MAX, *[0] * 12], stash_tokens=4)
    assert not [i for i in reference if out[i] != reference[i]]
    assert counters["enabled"] and counters["flushes"] > 0 and counters["stash_tokens"] == 4, counters


def test_a_failure_in_the_skip_turns_it_off_for_good_and_the_head_runs_again(reference, peagle, loop):
    out, _, counters = _run(peagle, loop, SWITCHING, inject_fault=True, skip=True)
    assert not [i for i in reference if out[i] != reference[i]]
    assert not counters["enabled"] and counters["skipped_steps"] == 0, counters
    assert counters["k0_head_runs"] > 0, counters  # K=0 steps ran the head, as before the skip


def test_a_gap_left_open_by_a_finished_request_is_not_hit_in_the_prefix_cache(peagle, loop):
    """A request that runs under K=0 throughout ends with its whole sequence stashed and
    never caught up: its blocks hold the target's KV but no head KV, and stay cached while
    K=0 holds. The same prompt run again (drafting) must draft as on a fresh cache: the
    blocks leave the cache before its first step; with the eviction off it hits them and
    drafts over the hole (the negative control). The fresh run comes last, so no block can
    hold this prompt's head KV before it."""
    prompt = [{**humaneval_requests(limit=len(PROMPTS) + 1)[-1], "max_tokens": 16}]

    def drafts_after_a_k0_run(**settings):
        _, _, first = _run(peagle, loop, [0], prompt, reset_prefix_cache=True, keep_after_steps=0, **settings)
        assert first["head_forwards"] == 0 and first["stashed_prompt_tokens"] >= 64, first
        out, _, again = _run(peagle, loop, [K_MAX], prompt)
        return first, again, out

    hole_first, hole_again, _ = drafts_after_a_k0_run(evict_holes=False)
    evict_first, evict_again, out = drafts_after_a_k0_run()
    _, _, fresh = _run(peagle, loop, [K_MAX], prompt, reset_prefix_cache=True)
    assert hole_first["kept_holes"] == 0 and hole_first["evicted_blocks"] == 0, hole_first
    # kept through the K=0 run, evicted before the drafting one: the prompt's blocks and the output's
    assert evict_first["evicted_blocks"] == 0 and evict_first["kept_holes"] >= 2, evict_first
    assert evict_again["evicted_blocks"] >= 2, evict_again
    same_evicted, n = _same_drafts(evict_again["drafts"], fresh["drafts"])
    same_hole, _ = _same_drafts(hole_again["drafts"], fresh["drafts"])
    print(f"drafts equal to a fresh cache's at {n} points: gap evicted {same_evicted:.3f}, hole hit {same_hole:.3f}")
    assert n >= 3, n
    assert same_evicted >= 0.97, same_evicted
    assert same_hole <= same_evicted - 0.2, (same_hole, same_evicted)
