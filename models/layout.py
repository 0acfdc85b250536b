"""On-disk layout of the tiny model directories, and nothing else.

Owns: which files a target directory and a head directory hold, writing them with
stable bytes (sorted JSON, safetensors from numpy), and hashing weights files.
A training step writes its trained tensors through `write_target_dir` /
`write_head_dir` and gets directories vLLM loads exactly like the random ones.

Knows nothing about how tensors are initialized or trained, or about vLLM.

    <out>/target/       config.json, generation_config.json, model.safetensors,
                        tokenizer.json, tokenizer_config.json, special_tokens_map.json
    <out>/peagle-head/  config.json (mask_token_id), model.safetensors (mask_hidden)
    <out>/eagle3-head/  config.json, model.safetensors
    <out>/build_info.json
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from models.spec import TinySpec, generation_config, head_config, target_config
from models.tokenizer import save_tokenizer, write_json

TARGET_DIRNAME = "target"
PEAGLE_HEAD_DIRNAME = "peagle-head"
EAGLE3_HEAD_DIRNAME = "eagle3-head"
WEIGHTS_FILENAME = "model.safetensors"
BUILD_INFO_FILENAME = "build_info.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_weights(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write float32 tensors as safetensors (deterministic header and byte order)."""
    from safetensors.numpy import save_file

    arrays = {}
    for name, value in tensors.items():
        if value.dtype != np.float32:
            raise ValueError(f"tensor {name!r} must be float32, got {value.dtype}")
        arrays[name] = np.ascontiguousarray(value)
    save_file(arrays, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors writes 0600; readers may be other users


def write_target_dir(
    model_dir: Path, spec: TinySpec, tokenizer, tensors: Mapping[str, np.ndarray]
) -> Path:
    """A `LlamaForCausalLM` directory vLLM and transformers load; returns weights path."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    write_json(model_dir / "config.json", target_config(spec))
    write_json(model_dir / "generation_config.json", generation_config())
    save_tokenizer(tokenizer, model_dir)
    weights_path = model_dir / WEIGHTS_FILENAME
    save_weights(weights_path, tensors)
    return weights_path


def write_head_dir(
    model_dir: Path,
    spec: TinySpec,
    tensors: Mapping[str, np.ndarray],
    parallel_drafting: bool,
) -> Path:
    """An EAGLE-3 (or, with parallel_drafting, P-EAGLE) head directory; returns weights path."""
    if parallel_drafting != ("mask_hidden" in tensors):
        raise ValueError(
            f"parallel_drafting={parallel_drafting!r} but mask_hidden "
            f"{'present' if 'mask_hidden' in tensors else 'absent'} in the tensors"
        )
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    write_json(model_dir / "config.json", head_config(spec, parallel_drafting))
    weights_path = model_dir / WEIGHTS_FILENAME
    save_weights(weights_path, tensors)
    return weights_path
