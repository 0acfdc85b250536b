"""Which K a live table may use, and how a P-EAGLE step's draft pass is laid out for its K
(configs.spec_k, actors.any_k): plain numbers, no engine. The engine-level proof
(lossless at every K, the K asked for is the K that ran, raw vLLM still broken) is in
tests/integration/test_live_schedule.py."""

import pytest

from actors.any_k import slots_for
from configs.spec_k import allowed_k

pytestmark = pytest.mark.unit


def test_a_step_drafting_k_tokens_lays_out_the_bonus_and_k_minus_1_mask_slots():
    assert slots_for(4) == (4, 3)
    assert slots_for(2) == (2, 1)
    assert slots_for(1) == (1, 0)  # one-token EAGLE: no mask slot
    assert slots_for(0) == (1, 0)  # the head runs over the step's tokens only, samples nothing
    with pytest.raises(ValueError, match="got -1"):
        slots_for(-1)


def test_p_eagle_runs_every_k_on_an_eager_engine_with_the_plugin_and_only_0_or_k_max_without():
    assert allowed_k(4, [4] * 8, graphs_captured=False, parallel_drafting=True) == [0, 1, 2, 3, 4]
    assert allowed_k(4, [4] * 8, graphs_captured=False, parallel_drafting=True,
                     any_k_installed=False) == [0, 4]


def test_with_cuda_graphs_only_the_start_up_tables_k_values_run():
    startup = [4, 4, 2, 2, 0, 0]
    assert allowed_k(4, startup, graphs_captured=True, parallel_drafting=True) == [0, 2, 4]
    assert allowed_k(4, startup, graphs_captured=True, parallel_drafting=False) == [0, 2, 4]
    assert allowed_k(4, startup, graphs_captured=False, parallel_drafting=False) == [0, 1, 2, 3, 4]


def test_a_plain_engine_runs_only_k_0():
    assert allowed_k(0, [], graphs_captured=False, parallel_drafting=False) == [0]
