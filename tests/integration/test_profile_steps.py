"""`tools.profile_steps` on the tiny model: one engine, K moved live, a calibration out.

Runs the job as a user would (its own process: the engine core is spawned from it), on
a small grid, and reads the file back with `control.calibration.load_calibration`, the
way the speculation controller does. Asserts what a user of the file relies on, not
timings: every point measured, the fit positive and drafting dearer than not drafting,
the engine's limits and the head's acceptance recorded, and where each step's time goes
(target, draft, other). ≈ 30-60 s on 2 cores.
"""

import subprocess
import sys

import pytest

from configs import load_config
from control.calibration import load_calibration
from tools.fit_calibration import k0_pairs
from control.model import plain_step_time_s

pytestmark = pytest.mark.integration

BATCH_SIZES = (1, 4)
KS = (0, 4)


@pytest.fixture(scope="module")
def profiled(tiny_models, repo_root, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("calibration")
    out, plot = out_dir / "cpu-test.json", out_dir / "steps.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.profile_steps", "--config", "tiny", "--out", str(out),
         "--batch-sizes", ",".join(map(str, BATCH_SIZES)), "--ks", ",".join(map(str, KS)),
         "--tokens", "24", "--repeats", "2", "--max-repeats", "2", "--long-context", "0", "--plot", str(plot)],
        cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return load_calibration(out), proc.stdout, plot


def test_every_point_is_measured_in_a_calibration_the_controller_loads(profiled):
    cal, stdout, _ = profiled
    assert cal.status == "measured" and cal.name == "cpu-test"
    assert sorted((m.batch_size, m.num_speculative_tokens) for m in cal.measurements) == [
        (b, k) for b in BATCH_SIZES for k in KS]
    for m in cal.measurements:
        assert m.step_time_s > 0 and m.num_steps >= 3
        assert m.num_context_tokens > m.batch_size  # prompt plus generated tokens, batch total
    progress = [line for line in stdout.splitlines() if line.startswith("B=")]
    assert len(progress) == len(cal.measurements)


def test_fit_is_positive_and_never_predicts_drafting_cheaper(profiled):
    # Properties of the fit, whatever this machine's speed: every coefficient is a cost
    # (>= 0), so drafting never comes out cheaper than not drafting, and the residual
    # table the file carries is the fitted model against each measurement.
    cal, _, _ = profiled
    assert all(c >= 0 for c in cal.cost.coefficients()) and cal.cost.fixed_s + cal.cost.per_token_s > 0
    for b in BATCH_SIZES:
        context = next(m.num_context_tokens for m in cal.measurements if m.batch_size == b)
        assert cal.cost.step_time_s(b, 4, context) >= cal.cost.step_time_s(b, 0, context) > 0
    assert len(cal.fit["residuals"]) == len(cal.measurements)
    for r in cal.fit["residuals"]:
        m = next(m for m in cal.measurements
                 if (m.batch_size, m.num_speculative_tokens) == (r["batch_size"], r["num_speculative_tokens"]))
        predicted = cal.cost.step_time_s(m.batch_size, m.num_speculative_tokens, m.num_context_tokens,
                                         m.num_prefill_tokens)
        assert r["fitted_step_time_s"] == pytest.approx(predicted, rel=1e-3)


def test_engine_limits_and_head_acceptance_are_recorded(profiled):
    cal, _, plot = profiled
    engine = load_config("tiny").engine
    assert cal.max_num_seqs == engine.max_num_seqs
    assert cal.max_num_speculative_tokens == engine.spec.num_speculative_tokens
    assert cal.kv_capacity_tokens > max(BATCH_SIZES) * 100
    # The trained P-EAGLE head gets drafts accepted, fewer at deeper positions.
    assert len(cal.acceptance_per_pos) == max(KS)
    assert cal.acceptance_per_pos[0] > 0
    assert cal.acceptance_per_pos[0] >= cal.acceptance_per_pos[-1]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plain_engine_is_measured_beside_the_speculating_one(profiled):
    # What restarting without the drafter would save: K=0 steps of both engines at every
    # batch size, and the drafter's K=0 cost fitted from them (a cost: >= 0).
    cal, stdout, _ = profiled
    pairs = k0_pairs(cal.plain_measurements)
    assert [plain.batch_size for plain, _ in pairs] == list(BATCH_SIZES)
    for plain, with_drafter in pairs:
        assert plain.drafting == "none" and plain.num_speculative_tokens == with_drafter.num_speculative_tokens == 0
        assert plain.step_time_s > 0 and with_drafter.step_time_s > 0 and plain.num_steps >= 3
        assert 0 < plain_step_time_s(cal.cost, plain.batch_size, plain.num_context_tokens) <= cal.cost.step_time_s(
            plain.batch_size, 0, plain.num_context_tokens)
    assert cal.cost.k0_draft_fixed_s >= 0 and cal.cost.k0_draft_per_req_s >= 0
    assert "with the drafter" in stdout and "what a plain engine saves" in stdout


def test_each_point_says_where_its_step_goes(profiled):
    # The engine core's split of a decode step: the target model and the rest at every
    # point; the drafter at every point of the speculating engine, K=0 included (vLLM runs
    # the drafter's first pass there too: what a plain engine saves), and never on the
    # plain engine, whose steps carry no drafter at all.
    cal, stdout, _ = profiled
    for m in cal.measurements:
        split = m.split_s
        assert set(split) == {"target", "draft", "other", "between_steps"}
        assert split["target"] > 0 and split["draft"] > 0 and split["other"] >= 0 and split["between_steps"] >= 0
    for plain, with_drafter in k0_pairs(cal.plain_measurements):
        assert plain.split_s["target"] > 0 and plain.split_s["draft"] == 0
        assert with_drafter.split_s["draft"] > 0
    assert stdout.count("+ draft") >= len(cal.measurements)
