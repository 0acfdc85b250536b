"""Build the embedded tiny models: a Llama target plus P-EAGLE and EAGLE-3 heads.

    python -m models.build_tiny --out artifacts/tiny [--seed 0] [--force]

Owns: the build as a whole (tokenizer → target → heads → `build_info.json`), the
"skip when already built for this seed" rule, the swap of a finished build into
place (so a reader never sees half a directory), and the CLI.

Knows nothing about vLLM: the directories are checked against vLLM by
`tests/integration/test_tiny_models.py`. Shapes live in `models.spec`, tensors in
`models.weights`, the tokenizer in `models.tokenizer`, file layout in `models.layout`.

Same seed on the same machine → byte-identical files (the tokenizer corpus is this
interpreter's standard library, so another Python version trains other merges).

Trained builds: `models.export` writes trained tensors through the same `build()`
(`trained=...`); their `build_info.json` says `"trained": true`. Without `force`, a
build never replaces a complete trained build (any seed), and refuses to replace a
trained build whose files no longer match their recorded sha256 (restore it with
git, or retrain with `python -m models.train_all`), so `make install` and
`ensure_built()` leave the committed trained models alone.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from models import layout, weights
from models.spec import TinySpec
from models.tokenizer import DEFAULT_CORPUS_MAX_BYTES, MASK_TOKEN, SPECIAL_TOKEN_IDS, train_tokenizer, write_json

# Bump when anything that changes the bytes of a build changes (forces a rebuild).
BUILDER_VERSION = 2
REPO_ROOT = Path(__file__).resolve().parent.parent


def default_artifacts_dir() -> Path:
    """`<repo>/artifacts/tiny`, absolute."""
    return REPO_ROOT / "artifacts" / "tiny"


@dataclass(frozen=True)
class TinyArtifacts:
    """Where a finished build lives; `info` is its `build_info.json`."""

    root: Path
    info: dict

    @property
    def target_dir(self) -> Path:
        return self.root / layout.TARGET_DIRNAME

    @property
    def peagle_head_dir(self) -> Path:
        return self.root / layout.PEAGLE_HEAD_DIRNAME

    @property
    def eagle3_head_dir(self) -> Path:
        return self.root / layout.EAGLE3_HEAD_DIRNAME

    @property
    def mask_token_id(self) -> int:
        return int(self.info["mask_token_id"])


def _log(message: str) -> None:
    print(f"[build_tiny] {message}", flush=True)


def _read_info(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / layout.BUILD_INFO_FILENAME).read_text())
    except (OSError, ValueError):
        return None


def is_built(out_dir: Path, seed: int = 0, spec: TinySpec | None = None) -> bool:
    """True when out_dir holds a complete build of this builder version, seed and
    spec, with every recorded file matching its recorded sha256."""
    info = _read_info(Path(out_dir))
    if info is None or info.get("seed") != seed:
        return False
    if info.get("spec") != (spec or TinySpec()).to_dict():
        return False
    if info.get("builder_version") != BUILDER_VERSION:
        return False
    return _files_intact(out_dir, info)


def _files_intact(out_dir: Path, info: dict) -> bool:
    """Every file build_info.json records exists with its recorded sha256."""
    files = info.get("files", {})
    return bool(files) and all(
        (Path(out_dir) / rel).is_file()
        and layout.sha256_file(Path(out_dir) / rel) == entry["sha256"]
        for rel, entry in files.items()
    )


def _build_into(out_dir: Path, seed: int, spec: TinySpec, trained: dict | None = None) -> dict:
    """Random tensors for seed, or (trained) the given ones: `trained` maps "target",
    "peagle-head", "eagle3-head" to float32 numpy tensors, "training" to a summary
    recorded in build_info.json and, optionally, "tokenizer" to the already trained
    tokenizer (saves training it again)."""
    started = time.monotonic()
    tokenizer = (trained or {}).get("tokenizer") or train_tokenizer(
        spec.vocab_size, DEFAULT_CORPUS_MAX_BYTES)
    _log(f"tokenizer: byte-level BPE, {tokenizer.get_vocab_size()} tokens "
         f"({time.monotonic() - started:.1f}s)")

    files: dict[str, dict] = {}
    num_params: dict[str, int] = {}

    def record(name: str, weights_path: Path, tensors: dict) -> None:
        rel = weights_path.relative_to(out_dir).as_posix()
        files[rel] = {
            "sha256": layout.sha256_file(weights_path),
            "num_bytes": weights_path.stat().st_size,
        }
        num_params[name] = int(sum(t.size for t in tensors.values()))
        _log(f"{name}: {num_params[name] / 1e6:.2f}M params, "
             f"{files[rel]['num_bytes'] / 2**20:.1f} MiB -> {weights_path.parent.name}/")

    target = trained["target"] if trained else weights.target_weights(spec, seed)
    record("target", layout.write_target_dir(
        out_dir / layout.TARGET_DIRNAME, spec, tokenizer, target), target)
    tokenizer_path = out_dir / layout.TARGET_DIRNAME / "tokenizer.json"
    files[tokenizer_path.relative_to(out_dir).as_posix()] = {
        "sha256": layout.sha256_file(tokenizer_path),
        "num_bytes": tokenizer_path.stat().st_size,
    }
    for name, dirname, parallel in (
        ("peagle-head", layout.PEAGLE_HEAD_DIRNAME, True),
        ("eagle3-head", layout.EAGLE3_HEAD_DIRNAME, False),
    ):
        head = (trained[name] if trained
                else weights.head_weights(spec, seed, parallel_drafting=parallel))
        record(name, layout.write_head_dir(out_dir / dirname, spec, head, parallel), head)

    info = {
        "builder_version": BUILDER_VERSION,
        "seed": seed,
        "dtype": "float32",
        "spec": spec.to_dict(),
        "mask_token_id": SPECIAL_TOKEN_IDS[MASK_TOKEN],
        "special_token_ids": dict(SPECIAL_TOKEN_IDS),
        "tokenizer_corpus": {
            "source": "stdlib .py files, sorted, site-packages excluded",
            "max_bytes": DEFAULT_CORPUS_MAX_BYTES,
            "python_version": ".".join(map(str, sys.version_info[:3])),
        },
        "num_params": num_params,
        "files": files,
    }
    if trained:
        info["trained"] = True
        info["training"] = trained["training"]
    write_json(out_dir / layout.BUILD_INFO_FILENAME, info)
    return info


def build(out_dir: Path, seed: int = 0, force: bool = False,
          spec: TinySpec | None = None, trained: dict | None = None) -> TinyArtifacts:
    """Build into out_dir unless it already holds this seed's build (or force).

    With `trained` (see `_build_into`), always writes those tensors. Without force,
    a complete trained build already in out_dir is kept whatever the seed, and a
    damaged trained build is an error rather than silently replaced by random weights.

    Builds in a sibling temporary directory and swaps it in, under a lock file
    next to out_dir, so concurrent callers build once and readers never see a
    partial directory.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    spec = spec or TinySpec()
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        info = _read_info(out_dir)
        if not force and trained is None and info and info.get("trained"):
            if not _files_intact(out_dir, info):
                raise RuntimeError(
                    f"{out_dir} holds a trained build whose files do not match "
                    f"build_info.json; restore it (git checkout -- {out_dir}) or "
                    "retrain (python -m models.train_all), or pass force to replace "
                    "it with random weights"
                )
            _log(f"trained build present, left alone: {out_dir}")
            return TinyArtifacts(out_dir, info)
        if not force and trained is None and is_built(out_dir, seed, spec):
            _log(f"up to date: {out_dir} (seed {seed})")
            return TinyArtifacts(out_dir, info or {})
        started = time.monotonic()
        _log(f"building {out_dir} (seed {seed})")
        tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        try:
            info = _build_into(tmp_dir, seed, spec, trained)
            if out_dir.exists():
                old_dir = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
                out_dir.rename(old_dir)
                tmp_dir.rename(out_dir)
                shutil.rmtree(old_dir, ignore_errors=True)
            else:
                tmp_dir.rename(out_dir)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        _log(f"done in {time.monotonic() - started:.1f}s")
        return TinyArtifacts(out_dir, info)


def ensure_built(out_dir: Path | str | None = None, seed: int = 0) -> TinyArtifacts:
    """The tiny models: a trained build when one is there, else this seed's random
    build (built first if missing or stale)."""
    return build(Path(out_dir) if out_dir is not None else default_artifacts_dir(), seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.build_tiny",
        description="Build the tiny Llama target and its P-EAGLE / EAGLE-3 heads.",
    )
    parser.add_argument("--out", type=Path, default=default_artifacts_dir(),
                        help="output directory (default: <repo>/artifacts/tiny)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild (random weights) even when build_info.json matches "
                             "the seed or records a trained build")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed!r}")
    artifacts = build(args.out, seed=args.seed, force=args.force)
    for path in (artifacts.target_dir, artifacts.peagle_head_dir, artifacts.eagle3_head_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
