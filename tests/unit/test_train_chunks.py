"""`models.train_chunks`: chunked training resumes exactly and is deterministic.

A tiny spec (vocab 512, hidden 64, 2 layers) on a synthetic Markov-chain corpus (no
tokenizer), one torch thread, a few steps per phase. Covers: one call == many
`--max-steps 2` calls (bit-identical tensors and loss histories), two fresh dirs agree,
the target's loss falls, a changed plan or a late `--init` is refused, `--init` shape
checks, and `DIR/trained/` reads back with `models.train_core.load_sharded`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from models import train_chunks as tc
from models.spec import TinySpec
from models.torch_llama import TinyLlama
from models.train_core import load_sharded, save_sharded

pytestmark = pytest.mark.unit

VOCAB = 512
SPEC = TinySpec(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, intermediate_size=128,
                max_position_embeddings=256, aux_layer_ids=(0, 1, 2), draft_vocab_size=VOCAB,
                head_num_hidden_layers=1, peagle_head_num_hidden_layers=2)


def _plan(target_steps: int = 6, head_steps: int = 4, seed: int = 0, target_lr: float = 3e-3) -> tc.Plan:
    return tc.Plan(name="test", spec=SPEC.to_dict(), phases=(
        tc.PhaseSpec(name="target", steps=target_steps, batch_size=4, seq_len=32,
                     peak_lr=target_lr, warmup_fraction=0.1, final_lr_ratio=0.1,
                     weight_decay=0.1, grad_clip=1.0, seed=seed, eval_windows=4),
        tc.PhaseSpec(name="heads", steps=head_steps, batch_size=4, seq_len=24, peak_lr=3e-3,
                     warmup_fraction=0.1, final_lr_ratio=0.05, weight_decay=0.01,
                     grad_clip=1.0, seed=seed, eval_sequences=2, num_depths=3,
                     num_generated=6, prompt_len=8, cod_ratio=0.7, cod_min_ratio=0.2,
                     pool_piece=4),
    ))


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    """A noisy Markov chain over ids 8..VOCAB-1 (learnable), `<|eos|>` (2) every ~200."""
    nxt = np.random.default_rng(123).permutation(np.arange(8, VOCAB))
    out = np.empty(n, dtype=np.uint16)
    cur = 8
    for i in range(n):
        if rng.random() < 0.005:
            out[i] = 2
            cur = 8 + int(rng.integers(VOCAB - 8))
            continue
        cur = int(nxt[cur - 8]) if rng.random() < 0.9 else 8 + int(rng.integers(VOCAB - 8))
        out[i] = cur
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    train, val = _tokens(rng, 20_000), _tokens(rng, 2_000)
    meta = {"vocab_size": VOCAB, "eos_id": 2, "tokenizer_sha256": "synthetic",
            "val_rule": "synthetic", "num_files": {"train": 1, "val": 1},
            "num_tokens": {"train": int(train.size), "val": int(val.size)}}
    path = tmp_path_factory.mktemp("corpus") / "corpus.npz"
    np.savez(path, train=train, val=val,
             meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    return path


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run_all(work: Path, plan: tc.Plan, corpus: Path, max_steps: int | None,
             save_every_minutes: float = 5.0) -> int:
    """Calls until the plan is finished; returns the number of calls."""
    calls = 0
    while True:
        state = tc.run_chunk(work, plan if calls == 0 else None, max_steps=max_steps,
                             corpus_path=corpus if calls == 0 else None,
                             save_every_minutes=save_every_minutes)
        calls += 1
        if state["finished"]:
            return calls
        assert calls < 50


def _result(work: Path) -> tuple[dict, dict]:
    trained = work / "trained"
    tensors = {stem: load_sharded(trained, stem) for stem in ("target", "peagle_head", "eagle3_head")}
    return tensors, json.loads((work / "state.json").read_text())["history"]


def _assert_same(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (ta, ha), (tb, hb) = a, b
    assert ha == hb
    for stem in ta:
        assert ta[stem].keys() == tb[stem].keys(), stem
        for key in ta[stem]:
            assert torch.equal(ta[stem][key], tb[stem][key]), (stem, key)


@pytest.fixture(scope="module")
def one_call(tmp_path_factory, corpus):
    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("one") / "run"
    assert _run_all(work, _plan(), corpus, max_steps=None) == 1
    return work


def test_chunked_resume_is_bit_identical_to_one_call(one_call, corpus, tmp_path):
    work = tmp_path / "chunked"
    calls = _run_all(work, _plan(), corpus, max_steps=2, save_every_minutes=1e-9)  # + a save a step
    assert calls >= 5  # 6 target + 4 head steps, 2 a call, each call reloading from disk
    _assert_same(_result(one_call), _result(work))
    hist = _result(work)[1]
    assert len(hist["target"]) == 6 and len(hist["peagle"]) == len(hist["eagle3"]) == 4
    state = json.loads((work / "state.json").read_text())
    assert [c["steps"] for c in state["chunks"]][:3] == [2, 2, 2]
    assert sorted(p.name for p in work.glob("ckpt-*")) == [state["checkpoint"]]


def test_fresh_dirs_give_identical_results_and_finished_dir_is_left_alone(one_call, corpus, tmp_path):
    work = tmp_path / "again"
    _run_all(work, _plan(), corpus, max_steps=None)
    _assert_same(_result(one_call), _result(work))
    state = tc.run_chunk(work)  # finished: nothing to do, nothing changes
    assert state["finished"] and len(state["chunks"]) == 1


def test_trained_dir_has_train_core_layout(one_call):
    trained = one_call / "trained"
    target = TinyLlama(SPEC)
    target.load_state_dict(load_sharded(trained, "target"))
    assert "mask_hidden" in load_sharded(trained, "peagle_head")
    assert "mask_hidden" not in load_sharded(trained, "eagle3_head")
    metrics = json.loads((trained / "metrics.json").read_text())
    from models.export import training_summary

    summary = training_summary(metrics)  # what models.export records: every key present
    assert summary["target"]["steps_run"] == 6 and summary["heads"]["steps_run"] == 4
    assert metrics["spec"] == SPEC.to_dict() and metrics["budget"] == "test"
    for name in ("peagle", "eagle3"):
        assert len(metrics["heads"][name]["val_generated"]["accuracy_per_depth"]) == 3


def test_target_loss_falls(corpus, tmp_path):
    plan = _plan(target_steps=30, target_lr=1e-2)
    tc.run_chunk(tmp_path / "w", plan, max_steps=30, corpus_path=corpus)
    losses = json.loads((tmp_path / "w" / "state.json").read_text())["history"]["target"]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def test_changed_plan_and_late_init_are_refused(corpus, tmp_path):
    work = tmp_path / "w"
    tc.run_chunk(work, _plan(), max_steps=1, corpus_path=corpus)
    with pytest.raises(tc.PlanMismatch, match=r"phases\[0\]\.steps: 6 -> 8"):
        tc.run_chunk(work, _plan(target_steps=8), max_steps=1)
    other_spec = replace(SPEC, intermediate_size=192).to_dict()
    with pytest.raises(tc.PlanMismatch, match=r"spec\.intermediate_size: 128 -> 192"):
        tc.run_chunk(work, replace(_plan(), spec=other_spec), max_steps=1)
    ckpt = work / json.loads((work / "state.json").read_text())["checkpoint"]
    with pytest.raises(ValueError, match="only allowed at the first chunk"):
        tc.run_chunk(work, max_steps=1, init_from=ckpt)
    assert tc.main(["--work", str(work), "--max-steps", "1", "--init", str(ckpt)]) == 2
    # the same plan (or none) continues
    assert tc.run_chunk(work, _plan(), max_steps=1)["step"] == 2
    assert tc.main(["--work", str(work), "--max-steps", "1"]) == 0
    assert json.loads((work / "state.json").read_text())["step"] == 3


def test_plan_round_trips_through_json(tmp_path):
    plan = _plan()
    again = tc.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert again.tiny_spec() == SPEC  # aux_layer_ids comes back a tuple
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    assert tc.load_plan_arg(str(path)) == plan
    assert tc.load_plan_arg("cpu").tiny_spec() == TinySpec()
    with pytest.raises(ValueError, match="heads phase: missing"):
        tc.PhaseSpec.from_dict({**plan.phases[1].to_dict(), "num_generated": None})


def test_batches_depend_only_on_seed_phase_and_step():
    a = tc.step_generator(0, "target", 5)
    b = tc.step_generator(0, "target", 5)
    assert torch.equal(torch.randint(0, 1000, (8,), generator=a), torch.randint(0, 1000, (8,), generator=b))
    seeds = {tc.step_seed(0, p, s) for p in ("target", "heads") for s in range(1000)}
    assert len(seeds) == 2000


def test_init_from_shards_validates_shapes(corpus, tmp_path):
    source = TinyLlama(SPEC)
    source.init_weights(7)
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    save_sharded({k: v.detach() for k, v in source.state_dict().items()}, src_dir, "target")

    work = tmp_path / "w"
    tc.run_chunk(work, _plan(), max_steps=1, init_from=src_dir, corpus_path=corpus)
    state = json.loads((work / "state.json").read_text())
    assert state["init"]["from"] == str(src_dir)

    # a heads-only plan trains against the frozen --init target
    heads_only = replace(_plan(), phases=(_plan().phases[1],))
    work2 = tmp_path / "heads"
    tc.run_chunk(work2, heads_only, init_from=src_dir, corpus_path=corpus)
    for key, value in load_sharded(work2 / "trained", "target").items():
        assert torch.equal(value, source.state_dict()[key]), key

    bigger = replace(_plan(), spec=replace(SPEC, intermediate_size=192).to_dict())
    with pytest.raises(ValueError, match=r"FROM has \(128, 64\), the plan's spec needs \(192, 64\)"):
        tc.run_chunk(tmp_path / "w3", bigger, max_steps=1, init_from=src_dir, corpus_path=corpus)
    grown = tc.init_target(bigger, source.state_dict(), grow=lambda plan, state: {
        k: v for k, v in TinyLlama(plan.tiny_spec()).state_dict().items()})
    assert grown["model.layers.0.mlp.up_proj.weight"].shape == (192, 64)


def test_a_phase_not_yet_started_may_change_and_the_change_is_recorded(corpus, tmp_path):
    work = tmp_path / "w"
    tc.run_chunk(work, _plan(), max_steps=2, corpus_path=corpus)  # in the target phase
    deeper = _plan()
    deeper = replace(deeper, phases=(deeper.phases[0], replace(deeper.phases[1], num_depths=4)))
    state = tc.run_chunk(work, deeper, max_steps=1)
    assert state["step"] == 3
    assert tc.Plan.from_dict(json.loads((work / "plan.json").read_text())) == deeper
    assert state["amendments"] == [{"at": "target step 2", "changes": ["phases[1].num_depths: 3 -> 4"]}]
    # the heads phase runs as amended: per-depth metrics for 4 depths
    finished = tc.run_chunk(work, None, max_steps=None)
    assert finished["finished"]
    scored = [v for v in finished["metrics"]["heads"]["peagle"].values() if isinstance(v, dict)
              and "accuracy_per_depth" in v]
    assert scored and all(len(v["accuracy_per_depth"]) == 4 for v in scored)
    # once the heads phase has started, it is fixed like the phases before it
    with pytest.raises(tc.PlanMismatch, match=r"phases\[1\]\.num_depths: 4 -> 3"):
        tc.run_chunk(work, _plan(), max_steps=1)


def test_heads_warm_started_from_a_trained_eagle3_head(one_call, corpus, tmp_path):
    from safetensors.torch import save_file

    from models.torch_head import EagleHead

    target_dir = one_call / "trained"  # the frozen target the heads are trained against
    one_layer = replace(SPEC, peagle_head_num_hidden_layers=1)
    target = TinyLlama(one_layer)
    target.load_state_dict(load_sharded(target_dir, "target"))
    source_head = EagleHead(one_layer, parallel_drafting=False)
    source_head.init_from_target(target, seed=99, aux_rms=1.0)  # not what the plan draws
    source = source_head.head_state_dict()
    head_dir = tmp_path / "eagle3-head"
    head_dir.mkdir()
    save_file(source, str(head_dir / "model.safetensors"))

    def heads_plan(init_heads, spec=one_layer):
        # an lr too small to move a weight visibly: after one step the heads show where
        # they started
        heads = replace(_plan().phases[1], init_heads=init_heads, peak_lr=1e-9)
        return tc.Plan(name="warm", spec=spec.to_dict(), phases=(heads,))

    def after_one_step(work, plan):
        state = tc.run_chunk(work, plan, max_steps=1, init_from=target_dir, corpus_path=corpus)
        ckpt = work / state["checkpoint"]
        return state, {name: load_sharded(ckpt, tc.HEAD_STEMS[name]) for name in tc.HEAD_NAMES}

    _, cold = after_one_step(tmp_path / "cold", heads_plan(None))
    state, warm = after_one_step(tmp_path / "warm", heads_plan(str(head_dir)))
    assert {n: v["from"] for n, v in state["init_heads"].items()} == dict.fromkeys(tc.HEAD_NAMES, str(head_dir))
    for name in tc.HEAD_NAMES:
        for key, value in source.items():
            assert torch.allclose(warm[name][key], value, atol=1e-6), (name, key)
            if key.startswith(("midlayer.", "fc.")) and "norm" not in key:
                assert not torch.allclose(cold[name][key], value, atol=1e-3), (name, key)
    # P-EAGLE's mask_hidden, which an EAGLE-3 head lacks, is the plan's own draw
    assert torch.allclose(warm["peagle"]["mask_hidden"], cold["peagle"]["mask_hidden"], atol=1e-6)
    assert tc.Plan.from_dict(json.loads((tmp_path / "warm" / "plan.json").read_text())) == heads_plan(
        str(head_dir))

    # one source per head: a P-EAGLE head starts from a P-EAGLE head, mask_hidden included
    peagle_dir = tmp_path / "peagle-head"
    peagle_dir.mkdir()
    peagle_source = {**source, "mask_hidden": torch.full((1, 3 * SPEC.hidden_size), 0.5)}
    save_file(peagle_source, str(peagle_dir / "model.safetensors"))
    _, each = after_one_step(tmp_path / "each", heads_plan({"peagle": str(peagle_dir),
                                                            "eagle3": str(head_dir)}))
    for key, value in peagle_source.items():
        assert torch.allclose(each["peagle"][key], value, atol=1e-6), key
    with pytest.raises(ValueError, match="exactly the keys"):
        heads_plan({"peagle": str(peagle_dir)})

    # a P-EAGLE head with a layer the EAGLE-3 head lacks cannot start from it
    with pytest.raises(ValueError, match=r"missing \['layers\.1\."):
        after_one_step(tmp_path / "bad", heads_plan(str(head_dir), spec=SPEC))
    # the field belongs to the heads phase only
    with pytest.raises(ValueError, match="target phase"):
        replace(_plan().phases[0], init_heads=str(head_dir))


def _heads_only_from(tmp_path, seed: int = 7) -> tuple[tc.Plan, Path]:
    """A heads-only plan and the --init target folder it trains against."""
    source = TinyLlama(SPEC)
    source.init_weights(seed)
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    save_sharded({k: v.detach() for k, v in source.state_dict().items()}, src_dir, "target")
    return replace(_plan(), phases=(_plan().phases[1],)), src_dir


def test_a_heads_only_run_keeps_no_target_in_its_checkpoints_and_resumes_exactly(corpus, tmp_path):
    # What a committed checkpoint of a heads-only run carries: the heads and their optimizer
    # state; the frozen target comes back from --init on resume, bit for bit.
    plan, src_dir = _heads_only_from(tmp_path)
    whole = tmp_path / "whole"
    tc.run_chunk(whole, plan, init_from=src_dir, corpus_path=corpus)
    chunked = tmp_path / "chunked"
    state = tc.run_chunk(chunked, plan, max_steps=1, init_from=src_dir, corpus_path=corpus)
    while not state["finished"]:
        assert not list((chunked / state["checkpoint"]).glob("target.*")), state["checkpoint"]
        assert list((chunked / state["checkpoint"]).glob("peagle_optim.*")), state["checkpoint"]
        state = tc.run_chunk(chunked, None, max_steps=1)
    _assert_same(_result(whole), _result(chunked))


def test_a_heads_only_run_refuses_a_changed_init_target_by_its_fingerprint(corpus, tmp_path):
    plan, src_dir = _heads_only_from(tmp_path)
    work = tmp_path / "w"
    state = tc.run_chunk(work, plan, max_steps=1, init_from=src_dir, corpus_path=corpus)
    other = TinyLlama(SPEC)
    other.init_weights(8)
    for shard in src_dir.glob("target.*"):
        shard.unlink()
    save_sharded({k: v.detach() for k, v in other.state_dict().items()}, src_dir, "target")
    with pytest.raises(ValueError, match=f"has changed since.*began with {state['init']['sha256'][:12]}"):
        tc.run_chunk(work, None, max_steps=1)


def test_a_missing_corpus_is_made_again_and_must_be_the_runs(corpus, tmp_path, monkeypatch):
    # A committed checkpoint leaves the corpus out: it is made again, and only the corpus
    # the run began with is accepted (the default corpus is deterministic; here the maker
    # is swapped for a copy of this test's corpus, or of another).
    import shutil

    import models.tokenizer
    import models.train_all

    work = tmp_path / "w"
    tc.run_chunk(work, _plan(), max_steps=1, corpus_path=corpus)
    made_from = {"path": corpus}
    monkeypatch.setattr(models.tokenizer, "train_tokenizer", lambda *a: None)
    monkeypatch.setattr(models.train_all, "ensure_corpus",
                        lambda path, budget, tok: shutil.copyfile(made_from["path"], path))
    (work / "corpus.npz").unlink()
    assert tc.run_chunk(work, None, max_steps=1)["step"] == 2
    other = tmp_path / "other.npz"
    np.savez(other, **{k: v for k, v in np.load(corpus).items() if k != "train"}, train=np.zeros(10, np.uint16))
    made_from["path"] = other
    (work / "corpus.npz").unlink()
    with pytest.raises(FileNotFoundError, match="not the run's"):
        tc.run_chunk(work, None, max_steps=1)
    assert not (work / "corpus.npz").exists()


def test_a_snapshot_mid_run_holds_the_checkpoints_heads_in_the_exported_layout(corpus, tmp_path):
    from models.export import training_summary

    plan, src_dir = _heads_only_from(tmp_path)
    work = tmp_path / "w"
    with pytest.raises(FileNotFoundError, match="nothing trained"):
        tc.snapshot(work, tmp_path / "snap")
    state = tc.run_chunk(work, plan, max_steps=2, init_from=src_dir, corpus_path=corpus)
    out = tc.snapshot(work, tmp_path / "snap")
    ckpt = work / state["checkpoint"]
    for name in tc.HEAD_NAMES:
        stem = tc.HEAD_STEMS[name]
        for key, value in load_sharded(ckpt, stem).items():
            assert torch.equal(load_sharded(out, stem)[key], value), (name, key)
    for key, value in load_sharded(out, "target").items():
        assert torch.equal(value, load_sharded(src_dir, "target")[key]), key
    summary = training_summary(json.loads((out / "metrics.json").read_text()))
    assert summary["heads"]["steps_run"] == 2
    # the run goes on untouched
    assert tc.run_chunk(work, None, max_steps=1)["step"] == 3
