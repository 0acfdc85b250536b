"""The load-aware controller is on in every shipped preset and one override turns it off;
what the jobs print about it. Config and report text only: nothing here runs an engine."""

import pytest

from configs import ConfigError, load_config
from configs.load import preset_names
from jobs.demo import controller_lines
from jobs.spec_gain import report

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_runs_the_controller_and_one_override_turns_it_off(preset):
    cfg = load_config(preset)
    assert cfg.engine.spec.method == "peagle" and cfg.engine.spec.controller is not None
    assert cfg.capacity_calibration() is not None  # the controller's calibration sizes the pool too
    for value in ("off", "false", "null", "'off'"):
        off = load_config(preset, [f"engine.spec.controller={value}"])
        assert off.engine.spec.controller is None, value
        assert off.engine.spec.num_speculative_tokens == cfg.engine.spec.num_speculative_tokens  # K pinned


def test_the_tiny_preset_keeps_its_drafter_and_gpu_presets_may_restart_without_it():
    assert load_config("tiny").engine.spec.controller.replacement.enabled is False
    assert load_config("tiny").engine.spec.controller.calibration == "cpu-tiny"
    gpu = load_config("qwen3-coder-30b-a3b-b200").engine.spec.controller
    assert gpu.replacement.enabled and gpu.calibration == "b200-qwen3-coder-30b-a3b"


def test_a_setting_under_a_switched_off_controller_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"'controller' is not a section"):
        load_config("tiny", ["engine.spec.controller=off", "engine.spec.controller.interval_s=1"])
    with pytest.raises(ConfigError, match=r"engine.spec.controller"):
        load_config("tiny", ["engine.spec.controller=sometimes"])


def test_the_demo_shows_the_share_of_steps_at_each_k_and_each_engines_table():
    lines = controller_lines({
        "e0": {"steps_by_k": {0: 30, 4: 10}, "table": [[1, 2, 4], [3, 32, 0]], "reason": "K=0 pays past 2"},
        "e1": {"steps_by_k": {"4": 60}, "table": None, "schedule": None, "reason": None}})
    assert lines[0] == "controller: engine steps by K: K=0 30%, K=4 70% (100 steps)"
    assert lines[1] == "  e0: batch size -> K 1-2:K=4 3-32:K=0; K=0 pays past 2"
    assert "(plain engine)" in lines[2]
    assert controller_lines(None) == [] and controller_lines({}) == []


def _gain(controller_k):
    return {"method": "peagle", "num_speculative_tokens": 4, "prompts": 8, "max_tokens": 64,
            "with": {"tokens_per_s": 120.0, "acceptance_length": 2.5, "controller_k": controller_k},
            "without": {"tokens_per_s": 100.0}, "speedup": 1.2, "identical_outputs": 8, "all_identical": True}


def test_the_speculation_gain_line_names_the_k_the_controller_chose_or_the_fixed_k():
    assert "(peagle controller chose K=3 of 0..4, acceptance length 2.50): 120.0 vs 100.0" in report(_gain(3))
    assert "(peagle K=4, acceptance length 2.50)" in report(_gain(None))
