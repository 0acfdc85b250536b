"""Depth growth keeps the trained target's outputs and the states its heads tap."""

import json
from pathlib import Path

import pytest
import torch

from models import train_chunks as tc
from models.grow import grow_depth, grow_for_plan
from models.spec import TinySpec
from models.torch_llama import TinyLlama

pytestmark = pytest.mark.unit

SMALL = dict(vocab_size=512, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, intermediate_size=128, max_position_embeddings=256,
             draft_vocab_size=512)
TRAINED = TinySpec(num_hidden_layers=2, aux_layer_ids=(0, 1, 2), **SMALL)
GROWN = TinySpec(num_hidden_layers=6, aux_layer_ids=(0, 3, 6), **SMALL)


def _trained() -> TinyLlama:
    model = TinyLlama(TRAINED)
    model.init_weights(7)
    with torch.no_grad():  # norms away from 1: a copy into the wrong slot would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(torch.linspace(0.5, 1.5, p.numel()))
    return model.eval()


def test_grown_target_gives_the_same_logits_and_tapped_states():
    torch.manual_seed(0)
    trained = _trained()
    grown = TinyLlama(GROWN)
    grown.load_state_dict(grow_depth(trained.state_dict(), GROWN, seed=3))
    grown.eval()
    ids = torch.randint(8, 512, (3, 40))
    with torch.no_grad():
        want_logits, want_aux = trained(ids, TRAINED.aux_layer_ids)
        got_logits, got_aux = grown(ids, GROWN.aux_layer_ids)
    assert torch.allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got_aux, want_aux, atol=1e-5, rtol=1e-5)


def test_new_layers_are_seeded_and_can_learn():
    state = grow_depth(_trained().state_dict(), GROWN, seed=3)
    again = grow_depth(_trained().state_dict(), GROWN, seed=3)
    assert all(torch.equal(state[k], again[k]) for k in state)
    for i in (1, 2, 4, 5):  # new: silent at the output, live inside
        assert not state[f"model.layers.{i}.self_attn.o_proj.weight"].any()
        assert not state[f"model.layers.{i}.mlp.down_proj.weight"].any()
        assert state[f"model.layers.{i}.self_attn.q_proj.weight"].std() > 0
    trained = _trained().state_dict()
    for old, new in ((0, 0), (1, 3)):
        assert torch.equal(state[f"model.layers.{new}.mlp.down_proj.weight"],
                           trained[f"model.layers.{old}.mlp.down_proj.weight"])


def test_a_depth_that_is_not_a_multiple_is_refused_naming_it():
    with pytest.raises(ValueError, match="multiple of the trained target's 2, got 5"):
        grow_depth(_trained().state_dict(), TinySpec(num_hidden_layers=5, aux_layer_ids=(0, 2, 5),
                                                     **SMALL), seed=0)


def test_init_target_grows_through_the_hook():
    plan = tc.Plan(name="grow", spec=GROWN.to_dict(), phases=(
        tc.PhaseSpec(name="target", steps=1, batch_size=1, seq_len=8, peak_lr=1e-3,
                     warmup_fraction=0.1, final_lr_ratio=0.1, weight_decay=0.0, grad_clip=1.0,
                     seed=3, eval_windows=1),
        tc.PhaseSpec(name="heads", steps=1, batch_size=2, seq_len=16, peak_lr=1e-3,
                     warmup_fraction=0.1, final_lr_ratio=0.05, weight_decay=0.01, grad_clip=1.0,
                     seed=3, eval_sequences=1, num_depths=3, num_generated=2, prompt_len=8,
                     cod_ratio=0.7, cod_min_ratio=0.2, pool_piece=2)))
    trained = _trained().state_dict()
    with pytest.raises(ValueError, match="does not fit the plan"):
        tc.init_target(plan, trained)
    state = tc.init_target(plan, trained, grow=grow_for_plan)
    assert state.keys() == TinyLlama(GROWN).state_dict().keys()


def test_the_deep16_plan_grows_the_4_layer_shape_into_the_committed_default():
    plan = tc.load_plan_arg("deep16")
    assert plan.tiny_spec().num_hidden_layers == 16 and plan.tiny_spec().aux_layer_ids == (4, 8, 12)
    base = TinyLlama(TinySpec())  # the 4-layer shape (artifacts/base4, tc.EARLIER_BUILDS)
    base.init_weights(1)
    state = tc.init_target(plan, base.state_dict(), grow=grow_for_plan)
    assert torch.equal(state["model.layers.12.mlp.up_proj.weight"],
                       base.state_dict()["model.layers.3.mlp.up_proj.weight"])
    # what the plans train is what ships: the committed default has deep16's target
    # shape, and its heads are the deep16-peagle3 plan's
    info = json.loads((Path(__file__).resolve().parents[2] / "artifacts/tiny/build_info.json").read_text())
    assert info["spec"] == tc.load_plan_arg("deep16-peagle3").spec
    assert {k: v for k, v in info["spec"].items() if k != "peagle_head_num_hidden_layers"} == \
        {k: v for k, v in plan.spec.items() if k != "peagle_head_num_hidden_layers"}
