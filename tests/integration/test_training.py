"""The training recipe runs end to end on a smoke budget and its build is usable.

Covers `models.train_all` (corpus → `models.train_core` → `models.export`): losses
fall, the target beats a unigram model on held-out files, the build records
`"trained": true`, vLLM loads the target with both trained heads and greedy
speculation stays lossless, and `build()` (what `make install` and `ensure_built()`
run) leaves a trained build alone but refuses to paper over a damaged one. Also: the
corpus file reads back with torch alone, and the torch target matches transformers.

The recipe and vLLM each run in a child process (one vLLM at a time, its thread
binding kept out of pytest). Runtime ≈ 65 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.build_tiny import build
from models.layout import WEIGHTS_FILENAME

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout_s: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, *args], check=False, cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        pytest.fail(f"{args[:2]} failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """A smoke-budget trained build (and the train_core output it came from)."""
    root = tmp_path_factory.mktemp("train")
    _run(["-m", "models.train_all", "--out", str(root / "tiny"), "--budget", "smoke",
          "--work", str(root / "work"), "--threads", "1"], timeout_s=300)
    metrics = json.loads((root / "work" / "trained-smoke" / "metrics.json").read_text())
    return {"root": root, "build": root / "tiny", "metrics": metrics,
            "corpus": root / "work" / "corpus-smoke.npz"}


@pytest.mark.integration
def test_smoke_training_lowers_losses_and_beats_unigram(smoke):
    target = smoke["metrics"]["target"]
    assert target["final_loss"] < target["first_loss"] - 0.5
    assert target["val_perplexity"] < target["unigram_val_perplexity"]
    for name in ("peagle", "eagle3"):
        head = smoke["metrics"]["heads"][name]
        assert head["final_loss"] < head["first_loss"], name
        assert len(head["val_corpus"]["accuracy_per_depth"]) == 4


@pytest.mark.integration
def test_trained_build_records_training_and_is_left_alone(smoke, tmp_path):
    info = json.loads((smoke["build"] / "build_info.json").read_text())
    assert info["trained"] is True
    assert info["training"]["budget"] == "smoke"
    assert set(info["files"]) == {"target/model.safetensors", "target/tokenizer.json",
                                  "peagle-head/model.safetensors", "eagle3-head/model.safetensors"}

    weights = smoke["build"] / "target" / WEIGHTS_FILENAME
    mtime_ns = weights.stat().st_mtime_ns
    for seed in (0, 1):  # what `make install` / ensure_built() run
        assert build(smoke["build"], seed=seed).info["trained"] is True
    assert weights.stat().st_mtime_ns == mtime_ns, "a trained build must not be rebuilt"

    import shutil

    damaged = tmp_path / "tiny"
    shutil.copytree(smoke["build"], damaged)
    (damaged / "eagle3-head" / WEIGHTS_FILENAME).write_bytes(b"truncated")
    with pytest.raises(RuntimeError, match="trained build"):
        build(damaged, seed=0)
    assert build(damaged, seed=0, force=True).info.get("trained") is None


@pytest.mark.integration
def test_vllm_serves_trained_heads_losslessly(smoke, tmp_path):
    out = tmp_path / "acceptance.json"
    _run(["-m", "models.measure_acceptance", "--models", str(smoke["build"]), "--limit", "2",
          "--max-tokens", "8", "--json", str(out)], timeout_s=300)
    report = json.loads(out.read_text())
    for name in ("peagle", "eagle3"):
        result = report["vllm"][name]
        assert result["identical_to_target"] == "2/2", name
        assert result["num_drafts"] > 0
        assert len(result["acceptance_per_pos"]) == 4
        assert name in report["offline_replay"]


@pytest.mark.integration
def test_corpus_reads_back_without_numpy_and_holds_out_files(smoke):
    import numpy as np

    from models.data import is_val_file, load_corpus

    corpus = load_corpus(smoke["corpus"])
    with np.load(smoke["corpus"]) as raw:
        assert corpus["train"].tolist() == raw["train"].astype(np.int64).tolist()
    meta = corpus["meta"]
    assert meta["num_files"]["val"] > 0 and meta["num_tokens"]["val"] == corpus["val"].numel()
    assert int(corpus["train"].max()) < meta["vocab_size"]
    held_out = sum(is_val_file(f"pkg/mod_{i}.py") for i in range(5000))
    assert 50 < held_out < 150, "about 2% of files are held out"


@pytest.mark.integration
def test_torch_target_matches_transformers(smoke):
    import torch
    from transformers import AutoModelForCausalLM

    from models.spec import TinySpec
    from models.torch_llama import TinyLlama
    from models.train_core import load_sharded

    hf = AutoModelForCausalLM.from_pretrained(smoke["build"] / "target", dtype=torch.float32).eval()
    ours = TinyLlama(TinySpec())
    ours.load_state_dict(load_sharded(smoke["root"] / "work" / "trained-smoke", "target"))
    ids = torch.randint(8, 4096, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, aux = ours.eval()(ids, (1, 2, 3))
        expected = hf(ids, output_hidden_states=True)
    assert torch.allclose(logits, expected.logits, atol=1e-4)
    hidden = expected.hidden_states  # [embeddings, after layer 0, 1, 2, 3 (normed)]
    assert torch.allclose(aux, torch.cat([hidden[1], hidden[2], hidden[3]], -1), atol=1e-4)
