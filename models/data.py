"""The training corpus: stdlib `.py` files → token arrays, a held-out split, one file.

    python -m models.data --out artifacts/train/corpus.npz [--budget full|smoke]

Owns: which files are held out (a file is in `val` when the first 8 hex digits of
sha256(its stdlib-relative path) mod 1000 < `VAL_PER_MILLE`: deterministic on every
machine and independent of which other files exist), how files are joined (each file's
tokens, then `<|eos|>`), and the corpus file format in both directions: `write_corpus`
(here, with the project's tokenizer) and `load_corpus` (anywhere, torch only, no numpy:
the GPU machine may have neither numpy nor tokenizers).

Format: an uncompressed `.npz` with `train` and `val` (uint16 token ids; the vocab is
4096) and `meta` (UTF-8 JSON as uint8: vocab size, eos id, tokenizer sha256, counts).

Knows nothing about models or training.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import numpy as np

from models.tokenizer import (
    DEFAULT_CORPUS_MAX_BYTES,
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    SPECIAL_TOKEN_IDS,
    stdlib_source_files,
    train_tokenizer,
)

VAL_PER_MILLE = 20  # ~2% of files held out
# Budgets cap the bytes of source read per split (files in sorted order).
BUDGETS = {
    "full": {"max_train_bytes": None, "max_val_bytes": None},
    "smoke": {"max_train_bytes": 1_200_000, "max_val_bytes": 150_000},
}


def is_val_file(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 1000 < VAL_PER_MILLE


def tokenizer_sha256(tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def write_corpus(out_path: Path, tokenizer, max_train_bytes: int | None = None,
                 max_val_bytes: int | None = None, stdlib_dir: Path | None = None,
                 extra_meta: dict | None = None) -> dict:
    """Tokenize the stdlib into out_path; returns the meta dict (extra_meta merged in)."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    eos_id = SPECIAL_TOKEN_IDS[EOS_TOKEN]
    texts: dict[str, list[str]] = {"train": [], "val": []}
    num_bytes = {"train": 0, "val": 0}
    caps = {"train": max_train_bytes, "val": max_val_bytes}
    for path in stdlib_source_files(root):
        split = "val" if is_val_file(path.relative_to(root).as_posix()) else "train"
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        size = len(text.encode("utf-8"))
        if caps[split] is not None and num_bytes[split] + size > caps[split]:
            continue
        texts[split].append(text)
        num_bytes[split] += size
    arrays, num_files = {}, {}
    for split, docs in texts.items():
        if not docs:
            raise RuntimeError(f"split {split!r} got no files; raise its byte budget")
        ids: list[int] = []
        for encoding in tokenizer.encode_batch(docs, add_special_tokens=False):
            ids.extend(encoding.ids)
            ids.append(eos_id)
        arrays[split] = np.asarray(ids, dtype=np.uint16)
        num_files[split] = len(docs)
    meta = {
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_id": eos_id,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "val_rule": f"sha256(stdlib-relative path)[:8] % 1000 < {VAL_PER_MILLE}",
        "num_files": num_files,
        "num_bytes": num_bytes,
        "num_tokens": {k: int(v.size) for k, v in arrays.items()},
        "python_version": ".".join(map(str, sys.version_info[:3])),
        **(extra_meta or {}),
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(out_path)
    return meta


def _read_npy(raw: bytes):
    """(descr, shape, payload) of a `.npy` blob (format versions 1-3)."""
    if raw[:6] != b"\x93NUMPY":
        raise ValueError(f"not a .npy blob: {raw[:6]!r}")
    major = raw[6]
    if major == 1:
        header_len, start = int.from_bytes(raw[8:10], "little"), 10
    else:
        header_len, start = int.from_bytes(raw[8:12], "little"), 12
    header = ast.literal_eval(raw[start:start + header_len].decode("latin1"))
    if header["fortran_order"]:
        raise ValueError("fortran-ordered arrays are not supported")
    return header["descr"], header["shape"], raw[start + header_len:]


def load_corpus(path: Path | str):
    """{"train": int64 tensor, "val": int64 tensor, "meta": dict}; needs torch only."""
    import torch

    out = {}
    with zipfile.ZipFile(path) as zf:
        for name in ("train", "val", "meta"):
            descr, shape, payload = _read_npy(zf.read(f"{name}.npy"))
            if name == "meta":
                out["meta"] = json.loads(payload.decode("utf-8"))
                continue
            if descr != "<u2" or len(shape) != 1:
                raise ValueError(f"{name}: expected 1-D '<u2', got {descr!r} {shape!r}")
            # int16 reinterpretation is exact: ids < 4096 < 2**15.
            tokens = torch.frombuffer(bytearray(payload), dtype=torch.int16).to(torch.int64)
            if tokens.numel() and int(tokens.min()) < 0:
                raise ValueError(f"{name}: token id >= 2**15 cannot be read as int16")
            out[name] = tokens
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.data", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="corpus .npz path")
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="full")
    args = parser.parse_args(argv)
    started = time.monotonic()
    tokenizer = train_tokenizer(DEFAULT_VOCAB_SIZE, DEFAULT_CORPUS_MAX_BYTES)
    meta = write_corpus(args.out, tokenizer, **BUDGETS[args.budget],
                        extra_meta={"budget": args.budget})
    print(json.dumps(meta, indent=2), f"\n{time.monotonic() - started:.1f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
