"""Turn `models.train_core` output (sharded `.pt` state dicts) into the directories vLLM loads.

    python -m models.export --trained artifacts/train/trained --out artifacts/tiny

Owns: the checks between training and the on-disk build: the corpus was tokenized
with the tokenizer this interpreter trains (same sha256; a build's tokenizer.json
must be the one the weights were trained with), every tensor the random builder
would write is present with the same shape and nothing else is, all values are
finite; and the summary of the training run recorded in `build_info.json`.

Knows nothing about how training works. Writing goes through `models.build_tiny.build`
(`trained=...`), so the file layout and the atomic swap are the random build's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from models.spec import TinySpec

STEMS = {"target": "target", "peagle-head": "peagle_head", "eagle3-head": "eagle3_head"}


def _load(trained_dir: Path, stem: str) -> dict[str, np.ndarray]:
    from models.train_core import load_sharded

    state = load_sharded(trained_dir, stem)
    return {k: np.ascontiguousarray(v.float().numpy()) for k, v in state.items()}


def _check(name: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(f"{name}: missing tensors {missing!r}, unexpected tensors {extra!r}")
    for key, value in got.items():
        if value.shape != want[key].shape:
            raise ValueError(f"{name}: {key} has shape {value.shape}, expected {want[key].shape}")
        if not np.isfinite(value).all():
            raise ValueError(f"{name}: {key} has non-finite values")


def training_summary(metrics: dict) -> dict:
    """The part of metrics.json worth keeping next to the weights."""
    target, heads = metrics["target"], metrics["heads"]
    summary = {
        "recipe": "python -m models.train_all (models.train_core + models.export)",
        "seed": metrics["seed"],
        "budget": metrics["budget"],
        "device": metrics["device_name"],
        "torch_version": metrics["torch_version"],
        "seconds_total": metrics["seconds_total"],
        "corpus": {k: metrics["corpus_meta"][k] for k in ("num_files", "num_tokens", "val_rule")},
        "target": {k: target[k] for k in ("steps_run", "tokens_seen", "first_loss", "final_loss",
                                          "val_perplexity", "unigram_val_perplexity")},
        "heads": {"steps_run": heads["steps_run"]},
    }
    # Where a chunked run started from (`models.train_chunks`: --init target, a warm-start
    # head): a heads-only plan's target section describes a target trained elsewhere.
    if target.get("init"):
        summary["target"]["init"] = target["init"]
    if metrics.get("heads_init"):
        summary["heads"]["init"] = metrics["heads_init"]
    for name in ("peagle", "eagle3"):
        summary["heads"][name] = heads[name]
    return summary


def export(trained_dir: Path, out_dir: Path, seed: int = 0, force_tokenizer: bool = False,
           tokenizer=None):
    """Write a trained build into out_dir (replacing what is there); returns TinyArtifacts.
    tokenizer: this interpreter's trained tokenizer, if the caller already has it."""
    from models import weights
    from models.build_tiny import build
    from models.data import tokenizer_sha256
    from models.tokenizer import (
        DEFAULT_CORPUS_MAX_BYTES,
        DEFAULT_VOCAB_SIZE,
        train_tokenizer,
    )

    trained_dir = Path(trained_dir)
    metrics = json.loads((trained_dir / "metrics.json").read_text())
    want_sha = metrics["corpus_meta"]["tokenizer_sha256"]
    tokenizer = tokenizer or train_tokenizer(DEFAULT_VOCAB_SIZE, DEFAULT_CORPUS_MAX_BYTES)
    got_sha = tokenizer_sha256(tokenizer)
    if got_sha != want_sha and not force_tokenizer:
        raise ValueError(
            f"the corpus was tokenized with tokenizer {want_sha[:12]}, this interpreter trains "
            f"{got_sha[:12]} (another Python version?); the weights would not match tokenizer.json"
        )
    spec = TinySpec.from_dict(metrics["spec"])  # the shape it was trained in (models.train_chunks plans vary it)
    tensors = {name: _load(trained_dir, stem) for name, stem in STEMS.items()}
    _check("target", tensors["target"], weights.target_weights(spec, seed))
    _check("peagle-head", tensors["peagle-head"], weights.head_weights(spec, seed, True))
    _check("eagle3-head", tensors["eagle3-head"], weights.head_weights(spec, seed, False))
    return build(Path(out_dir), seed=metrics["seed"], spec=spec,
                 trained={**tensors, "training": training_summary(metrics), "tokenizer": tokenizer})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.export", description=__doc__.split("\n")[0])
    parser.add_argument("--trained", type=Path, required=True, help="train_core output folder")
    parser.add_argument("--out", type=Path, required=True, help="build directory to (re)write")
    args = parser.parse_args(argv)
    artifacts = export(args.trained, args.out)
    print(json.dumps(artifacts.info["training"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
