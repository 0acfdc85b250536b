"""Rebuild the embedded tiny models from scratch: corpus → target → heads → build.

    python -m models.train_all --out artifacts/tiny [--device cpu|cuda] [--budget full|smoke]
                               [--seed 0] [--work artifacts/train]
    python -m models.train_all --out artifacts/tiny --from-trained DIR   # GPU output

Owns: the order of the three steps and where intermediate files go (`--work`:
`corpus-<budget>.npz`, `trained-<budget>/`), reusing a corpus file only when it was
made by this interpreter's tokenizer for this budget. The steps themselves live in
`models.data` (tokenize + split, here), `models.train_core` (torch only; the same
command runs on a GPU machine, see below) and `models.export` (here).

GPU machine without this venv: make the corpus here, train there, export here:
    python -m models.data --out artifacts/train/corpus-full.npz --budget full
    python -m models.train_core --corpus artifacts/train/corpus-full.npz \
        --out trained --device cuda --seed 0 --budget full        # on the GPU machine
    python -m models.train_all --out artifacts/tiny --from-trained trained

Knows nothing about model internals or vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from models.build_tiny import REPO_ROOT, default_artifacts_dir


def _log(message: str) -> None:
    print(f"[train_all] {message}", flush=True)


def ensure_corpus(path: Path, budget: str, tokenizer) -> dict:
    """The corpus for budget at path, (re)made unless it matches this tokenizer."""
    from models.data import BUDGETS, load_corpus, tokenizer_sha256, write_corpus

    if path.is_file():
        meta = load_corpus(path)["meta"]
        if meta.get("tokenizer_sha256") == tokenizer_sha256(tokenizer) and meta.get("budget") == budget:
            _log(f"corpus up to date: {path}")
            return meta
    started = time.monotonic()
    meta = write_corpus(path, tokenizer, **BUDGETS[budget], extra_meta={"budget": budget})
    _log(f"corpus {meta['num_tokens']} tokens in {time.monotonic() - started:.1f}s -> {path}")
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.train_all",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=default_artifacts_dir(),
                        help="build directory to (re)write (default: <repo>/artifacts/tiny)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--budget", choices=("full", "smoke"), default="full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=REPO_ROOT / "artifacts" / "train",
                        help="intermediate files (corpus, state dicts)")
    parser.add_argument("--from-trained", type=Path, default=None,
                        help="skip training: export this train_core output folder")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed!r}")
    if args.from_trained is None and args.budget == "full" and not args.device.startswith("cuda"):
        parser.error(f"--budget full needs a GPU (about 4 min on one H200), got --device "
                     f"{args.device!r}; on CPU use --budget smoke")
    if args.budget == "smoke" and args.from_trained is None and (
            args.out.resolve() == default_artifacts_dir().resolve()):
        parser.error("a smoke build would replace the committed trained models in "
                     f"{str(args.out)!r}; give --out another directory")

    import torch

    from models import train_core
    from models.export import export
    from models.tokenizer import (
        DEFAULT_CORPUS_MAX_BYTES,
        DEFAULT_VOCAB_SIZE,
        train_tokenizer,
    )

    torch.set_num_threads(args.threads)
    started = time.monotonic()
    tokenizer = train_tokenizer(DEFAULT_VOCAB_SIZE, DEFAULT_CORPUS_MAX_BYTES)
    trained_dir = args.from_trained
    if trained_dir is None:
        corpus_path = args.work / f"corpus-{args.budget}.npz"
        ensure_corpus(corpus_path, args.budget, tokenizer)
        trained_dir = args.work / f"trained-{args.budget}"
        train_core.run(corpus_path, trained_dir, args.device, args.seed, args.budget)
    artifacts = export(trained_dir, args.out, tokenizer=tokenizer)
    summary = artifacts.info["training"]
    _log(json.dumps({"out": str(artifacts.root), "target": summary["target"]}, indent=2))
    _log(f"done in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
