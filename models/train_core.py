"""The training run that needs only torch: corpus file in, state-dict files out.

    python -m models.train_core --corpus corpus.npz --out trained/ --device cuda \
        --seed 0 --budget full [--target-steps N] [--head-steps M]

Owns: the budgets (`full`: 255 s on one H200 for the committed build: target 58 s,
greedy pool 40 s, head loop capped at 130 s, evaluations; `smoke`: about 30 s on
one CPU thread), the order of work (target, then both heads against the frozen
target), and the output folder:
    target.NN.pt       Hugging Face `LlamaForCausalLM` names, float32
    peagle_head.NN.pt  EAGLE-3 checkpoint names + `mask_hidden`, float32
    eagle3_head.NN.pt  EAGLE-3 checkpoint names, float32
    (each state dict split into shards NN = 00, 01, ... of at most 12 MiB: the GPU
    machine hands back files of at most 16 MiB)
    metrics.json     configs, losses, held-out perplexities and head accuracies,
                     the corpus meta (tokenizer sha256) and torch/device versions

Knows nothing about tokenizers, safetensors, Hugging Face directories or vLLM: it runs
on a GPU machine that has only torch. `models.export` turns its output into the
directories vLLM loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from models.data import load_corpus
from models.spec import TinySpec
from models.tokenizer import MASK_TOKEN, SPECIAL_TOKEN_IDS
from models.train_common import log
from models.train_heads import HeadConfig, train_heads
from models.train_target import TargetConfig, train_target

BUDGETS: dict[str, tuple[TargetConfig, HeadConfig]] = {
    "full": (
        TargetConfig(steps=3000, batch_size=32, seq_len=1024, max_seconds=140.0, log_every=250),
        HeadConfig(steps=3000, batch_size=16, seq_len=512, num_generated=2048, prompt_len=128,
                   max_seconds=130.0, log_every=250),
    ),
    "smoke": (
        TargetConfig(steps=30, batch_size=8, seq_len=128, peak_lr=5e-3, max_seconds=30.0,
                     eval_windows=16, log_every=10),
        HeadConfig(steps=12, batch_size=4, seq_len=64, num_generated=8, prompt_len=16,
                   peak_lr=3e-3, max_seconds=15.0, eval_sequences=4, log_every=4),
    ),
}
STATE_DICTS = ("target", "peagle_head", "eagle3_head")
SHARD_BYTES = 12 * 2**20


def save_sharded(state: dict[str, torch.Tensor], out_dir: Path, stem: str) -> list[Path]:
    """Write state as `<stem>.00.pt`, `<stem>.01.pt`, ... (tensors whole, in key order)."""
    shards: list[dict] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    for old in out_dir.glob(f"{stem}.*.pt"):
        old.unlink()
    paths = [out_dir / f"{stem}.{i:02d}.pt" for i in range(len(shards))]
    for path, shard in zip(paths, shards):
        torch.save(shard, path)
    return paths


def load_sharded(out_dir: Path, stem: str) -> dict[str, torch.Tensor]:
    paths = sorted(Path(out_dir).glob(f"{stem}.[0-9][0-9].pt"))
    if not paths:
        raise FileNotFoundError(f"no {stem}.NN.pt shards in {str(out_dir)!r}")
    state: dict[str, torch.Tensor] = {}
    for path in paths:
        state.update(torch.load(path, map_location="cpu", weights_only=True))
    return state


def run(corpus_path: Path, out_dir: Path, device: str, seed: int, budget: str,
        target_steps: int | None = None, head_steps: int | None = None,
        target_max_s: float | None = None, head_max_s: float | None = None) -> dict:
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {sorted(BUDGETS)}, got {budget!r}")
    target_cfg, head_cfg = BUDGETS[budget]
    if target_steps is not None:
        target_cfg = replace(target_cfg, steps=target_steps)
    if head_steps is not None:
        head_cfg = replace(head_cfg, steps=head_steps)
    if target_max_s is not None:
        target_cfg = replace(target_cfg, max_seconds=target_max_s)
    if head_max_s is not None:
        head_cfg = replace(head_cfg, max_seconds=head_max_s)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    started = time.monotonic()
    spec = TinySpec()
    corpus = load_corpus(corpus_path)
    if corpus["meta"]["vocab_size"] != spec.vocab_size:
        raise ValueError(f"corpus vocab {corpus['meta']['vocab_size']!r} != spec {spec.vocab_size}")
    log("core", f"corpus {corpus['meta']['num_tokens']} tokens, device {dev}, budget {budget}")

    target, target_metrics = train_target(corpus, spec, target_cfg, dev, seed)
    heads, head_metrics = train_heads(target, corpus, spec, head_cfg, dev, seed,
                                      SPECIAL_TOKEN_IDS[MASK_TOKEN])

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target_sd = {k: v.detach().float().cpu().contiguous() for k, v in target.state_dict().items()}
    save_sharded(target_sd, out_dir, "target")
    save_sharded(heads["peagle"].head_state_dict(), out_dir, "peagle_head")
    save_sharded(heads["eagle3"].head_state_dict(), out_dir, "eagle3_head")
    metrics = {
        "seed": seed,
        "budget": budget,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "seconds_total": round(time.monotonic() - started, 1),
        "corpus_meta": corpus["meta"],
        "spec": spec.to_dict(),
        "target": target_metrics,
        "heads": head_metrics,
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    log("core", f"wrote {out_dir} in {metrics['seconds_total']}s")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.train_core",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="full")
    parser.add_argument("--target-steps", type=int, default=None)
    parser.add_argument("--head-steps", type=int, default=None)
    parser.add_argument("--target-max-s", type=float, default=None)
    parser.add_argument("--head-max-s", type=float, default=None)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: CPU runs share the machine)")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed!r}")
    torch.set_num_threads(args.threads)
    run(args.corpus, args.out, args.device, args.seed, args.budget, args.target_steps,
        args.head_steps, args.target_max_s, args.head_max_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
