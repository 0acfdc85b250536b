"""Train a P-EAGLE head and an EAGLE-3 head against a frozen target's own outputs.

Owns: the heads' training data (half random corpus windows, half the target's own
greedy continuations of corpus prefixes, so the heads also see the repetitive text a
small greedy model writes at inference), the two draft layouts, the loss (forward KL
to the target's next-token distribution, as soft cross-entropy), and the held-out
per-depth accuracy with the acceptance length it implies.

Layouts mirror what vLLM 0.32 feeds the head (`v1/spec_decode/llm_base_proposer.py`,
`copy_and_expand_eagle_inputs_kernel`); see `models.torch_head` for slots and mask:
- P-EAGLE, one pass: depth-0 slots at every anchor (token x[a+1], fc(target aux at a),
  position a); depth d = 1..K-1 slots use the `<|mask|>` embedding and fc(mask_hidden)
  at position a + d. Deeper depths keep a nested random subset of anchors
  (≈ n·max(0.7^d, 0.2), the paper's COD sampling) and the loss is the mean over all
  slots, so depth d weighs ∝ its slot count (as `speculators` does); the real
  depth-0 slot, which every accepted draft starts with, weighs most.
- EAGLE-3, training-time test: K sequential passes; pass s at position a + s reads
  token x[a+s+1] and the head's own pre-norm output of pass s-1 (H wide, not through
  fc), attending to pass-0 slots at anchors ≤ a and its own anchor's earlier passes.
Both predict, at slot (a, d), the target's distribution at position a + d + 1.

One optimizer step of both heads is `heads_step` (its only randomness, P-EAGLE's COD
slots, comes from the generator it is given; `heads_batch` draws the batch);
`train_heads` is the one-go loop around it that `models.train_core` runs,
`models.train_chunks` the resumable one.

Knows nothing about files, tokenizers or vLLM. Needs only torch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from models.spec import TinySpec
from models.torch_head import EagleHead, slot_mask
from models.torch_llama import TinyLlama, greedy_generate
from models.train_common import Progress, autocast, log, lr_at, sample_windows
from models.train_target import NUM_SPECIAL_TOKENS


@dataclass(frozen=True)
class HeadConfig:
    steps: int
    batch_size: int  # sequences per step (half corpus windows, half generated)
    seq_len: int
    num_depths: int = 4  # K: draft tokens per step in vLLM
    num_generated: int = 512  # greedy target continuations in the training pool
    prompt_len: int = 128  # corpus prefix each continuation starts from
    peak_lr: float = 2e-3
    warmup_fraction: float = 0.05
    final_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    cod_ratio: float = 0.7
    cod_min_ratio: float = 0.2
    max_seconds: float | None = None
    eval_sequences: int = 64  # held-out sequences of each kind scored at the end
    log_every: int = 100


def soft_ce(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per-slot cross-entropy of draft logits against target probabilities [B, S]."""
    return -(probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


@torch.no_grad()
def target_features(target: TinyLlama, ids: torch.Tensor, spec: TinySpec):
    """(aux hidden [B, T, 3H], target probs [B, T, V]) for token windows."""
    with autocast(ids.device):
        logits, aux = target(ids, spec.aux_layer_ids)
    return aux.float(), torch.softmax(logits.float(), dim=-1)


def peagle_slots(seq_len: int, cfg: HeadConfig, gen: torch.Generator | None):
    """(anchor, depth) of every slot; gen=None keeps every anchor at every depth."""
    prev = torch.arange(seq_len - 1)
    anchors, depths = [prev], [torch.zeros_like(prev)]
    for d in range(1, cfg.num_depths):
        valid = prev[prev <= seq_len - 2 - d]
        if gen is not None:
            keep = int((seq_len - 1 - d) * max(cfg.cod_ratio**d, cfg.cod_min_ratio))
            valid = valid[torch.randperm(valid.numel(), generator=gen)[:keep]].sort().values
        anchors.append(valid)
        depths.append(torch.full_like(valid, d))
        prev = valid
    return torch.cat(anchors), torch.cat(depths)


def peagle_forward(head: EagleHead, embed, ids, aux, probs, cfg: HeadConfig, mask_id: int,
                   gen: torch.Generator | None):
    """Per-slot loss and correctness [B, S] plus the slots' depth [S]."""
    device = ids.device
    anchor, depth = (t.to(device) for t in peagle_slots(ids.shape[1], cfg, gen))
    real = depth == 0
    tokens = torch.where(real, ids[:, (anchor + 1).clamp(max=ids.shape[1] - 1)],
                         torch.full_like(ids[:, anchor], mask_id))
    fused_real = head.fc(aux[:, anchor])
    fused_mask = head.fc(head.mask_hidden.to(aux.dtype))[None].expand_as(fused_real)
    hidden = torch.where(real[None, :, None], fused_real, fused_mask)
    logits, _ = head.step(embed(tokens), hidden, anchor + depth,
                          slot_mask(anchor, depth, anchor, depth))
    label = probs[:, anchor + depth + 1]
    correct = logits.argmax(-1) == label.argmax(-1)
    return soft_ce(logits, label), correct, depth


def eagle3_forward(head: EagleHead, embed, ids, aux, probs, cfg: HeadConfig):
    """Training-time test over K passes; per-slot loss/correctness [B, S] and depth [S]."""
    device, t = ids.device, ids.shape[1]
    hidden = head.fc(aux[:, : t - 1])
    cache, key_anchor, key_depth = head.new_kv_cache(), [], []
    losses, corrects, depths = [], [], []
    for s in range(cfg.num_depths):
        anchor = torch.arange(t - 1 - s, device=device)
        depth = torch.full_like(anchor, s)
        key_anchor.append(anchor)
        key_depth.append(depth)
        mask = slot_mask(anchor, depth, torch.cat(key_anchor), torch.cat(key_depth))
        logits, prenorm = head.step(embed(ids[:, anchor + s + 1]), hidden[:, : anchor.numel()],
                                    anchor + s, mask, cache)
        label = probs[:, anchor + s + 1]
        losses.append(soft_ce(logits, label))
        corrects.append(logits.argmax(-1) == label.argmax(-1))
        depths.append(depth)
        hidden = prenorm
    return torch.cat(losses, 1), torch.cat(corrects, 1), torch.cat(depths)


def depth_mean(values: torch.Tensor, depth: torch.Tensor, num_depths: int) -> torch.Tensor:
    """Mean over batch and slots, per depth → [num_depths]."""
    per_slot = values.float().mean(0)
    sums = torch.zeros(num_depths, device=values.device).index_add_(0, depth, per_slot)
    return sums / torch.bincount(depth, minlength=num_depths).clamp(min=1)


def acceptance_length(per_depth_accuracy: list[float]) -> float:
    """1 + Σ_k Π_{d≤k} acc_d. An optimistic proxy, for logs only: acc_d are per-depth
    marginals while a draft chain needs its depths right jointly (a one-layer P-EAGLE
    head with marginals .76/.23/.19/.16 had 0.4% of drafts reach depth 3 in vLLM).
    `models.measure_acceptance` replays the real accept loop."""
    total, chain = 1.0, 1.0
    for acc in per_depth_accuracy:
        chain *= acc
        total += chain
    return total


def generated_pool(target: TinyLlama, tokens: torch.Tensor, num: int, cfg: HeadConfig,
                   gen: torch.Generator, chunk: int = 512) -> torch.Tensor:
    """[num, seq_len]: corpus prefixes of prompt_len + the target's greedy continuation."""
    out = []
    banned = tuple(range(NUM_SPECIAL_TOKENS))
    target.eval()
    for i in range(0, num, chunk):
        prompts = sample_windows(tokens, min(chunk, num - i), cfg.prompt_len, gen)
        with autocast(tokens.device):
            out.append(greedy_generate(target, prompts, cfg.seq_len - cfg.prompt_len, banned))
    return torch.cat(out)


@torch.no_grad()
def evaluate(heads: dict, target, embed, batches: list, cfg: HeadConfig, spec, mask_id) -> dict:
    result = {}
    for name, head in heads.items():
        head.eval()
        acc = torch.zeros(cfg.num_depths, device=batches[0].device)
        for ids in batches:
            aux, probs = target_features(target, ids, spec)
            with autocast(ids.device):
                if name == "peagle":
                    _, correct, depth = peagle_forward(head, embed, ids, aux, probs, cfg, mask_id, None)
                else:
                    _, correct, depth = eagle3_forward(head, embed, ids, aux, probs, cfg)
            acc += depth_mean(correct, depth, cfg.num_depths) / len(batches)
        head.train()
        per_depth = [round(float(a), 4) for a in acc]
        result[name] = {"accuracy_per_depth": per_depth,
                        "implied_acceptance_length": round(acceptance_length(per_depth), 3)}
    return result


def make_eval_sets(target: TinyLlama, val_tokens: torch.Tensor, cfg: HeadConfig,
                   seed: int) -> dict[str, torch.Tensor]:
    """Held-out sequences of both kinds, drawn from a generator seeded by seed + 2."""
    n_eval = max(1, cfg.eval_sequences)
    eval_gen = torch.Generator().manual_seed(seed + 2)
    return {
        "val_corpus": sample_windows(val_tokens, n_eval, cfg.seq_len, eval_gen),
        "val_generated": generated_pool(target, val_tokens, n_eval, cfg, eval_gen),
    }


def init_heads(target: TinyLlama, pool: torch.Tensor, spec: TinySpec, cfg: HeadConfig,
               device: torch.device, seed: int) -> dict[str, EagleHead]:
    """{"peagle", "eagle3"} heads initialised from the target (seeds seed + 10, + 11);
    mask_hidden's scale is the RMS of the target's aux states on the pool's first batch."""
    aux0, _ = target_features(target, pool[: cfg.batch_size], spec)
    heads = {}
    for i, name in enumerate(("peagle", "eagle3")):
        head = EagleHead(spec, parallel_drafting=name == "peagle")
        head.init_from_target(target, seed + 10 + i, float(aux0.pow(2).mean().sqrt()))
        heads[name] = head.to(device).train()
    return heads


def make_optimizers(heads: dict[str, EagleHead], cfg: HeadConfig) -> dict[str, torch.optim.AdamW]:
    return {name: torch.optim.AdamW(head.parameters(), lr=cfg.peak_lr, betas=(0.9, 0.95),
                                    weight_decay=cfg.weight_decay)
            for name, head in heads.items()}


def heads_batch(pool: torch.Tensor, train_tokens: torch.Tensor, cfg: HeadConfig,
                gen: torch.Generator) -> torch.Tensor:
    """[batch_size, seq_len]: batch_size // 2 pool sequences, the rest corpus windows."""
    n_gen = cfg.batch_size // 2
    picks = torch.randint(0, pool.shape[0], (n_gen,), generator=gen).to(pool.device)
    return torch.cat([pool[picks], sample_windows(
        train_tokens, cfg.batch_size - n_gen, cfg.seq_len, gen)])


def heads_step(heads: dict[str, EagleHead], optims: dict, target: TinyLlama, ids: torch.Tensor,
               lr: float, cfg: HeadConfig, spec: TinySpec, mask_id: int,
               gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One optimizer step of each head on ids; returns per head the detached row
    [loss, accuracy at depth 0..K-1]. gen draws P-EAGLE's COD slots (its only randomness)."""
    device = ids.device
    embed = target.model.embed_tokens
    aux, probs = target_features(target, ids, spec)
    rows = {}
    for name, head in heads.items():
        with autocast(device):
            if name == "peagle":
                loss, correct, depth = peagle_forward(head, embed, ids, aux, probs, cfg, mask_id, gen)
            else:
                loss, correct, depth = eagle3_forward(head, embed, ids, aux, probs, cfg)
        if name == "peagle":  # mean over slots: COD sampling sets the depth weights
            loss = loss.float().mean()
        else:  # one pass per depth, all anchors: equal weights
            loss = depth_mean(loss, depth, cfg.num_depths).mean()
        optim = optims[name]
        for group in optim.param_groups:
            group["lr"] = lr
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        optim.step()
        rows[name] = torch.cat([loss.detach()[None], depth_mean(correct, depth, cfg.num_depths)])
    return rows


def head_loss_summary(losses: list[float]) -> dict:
    """first_loss / final_loss: means of the first and last 5% of steps (at least one)."""
    table = torch.tensor(losses, dtype=torch.float32)
    k = max(1, len(losses) // 20)
    return {"first_loss": round(float(table[:k].mean()), 4),
            "final_loss": round(float(table[-k:].mean()), 4)}


def train_heads(target: TinyLlama, corpus: dict, spec: TinySpec, cfg: HeadConfig,
                device: torch.device, seed: int, mask_id: int):
    """Returns ({"peagle": head, "eagle3": head}, metrics)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    target.eval().requires_grad_(False)
    embed = target.model.embed_tokens
    train_tokens, val_tokens = corpus["train"].to(device), corpus["val"].to(device)
    started = time.monotonic()
    pool = generated_pool(target, train_tokens, cfg.num_generated, cfg, gen)
    log("heads", f"generated pool {tuple(pool.shape)} in {time.monotonic() - started:.1f}s")
    eval_sets = make_eval_sets(target, val_tokens, cfg, seed)
    heads = init_heads(target, pool, spec, cfg, device, seed)
    optims = make_optimizers(heads, cfg)
    progress = Progress(cfg.steps, cfg.max_seconds)  # the cap covers the loop, not the pools
    history = {name: [] for name in heads}
    while not progress.done():
        lr = lr_at(progress.fraction, cfg.peak_lr, cfg.warmup_fraction, cfg.final_lr_ratio)
        ids = heads_batch(pool, train_tokens, cfg, gen)
        for name, row in heads_step(heads, optims, target, ids, lr, cfg, spec, mask_id, gen).items():
            history[name].append(row)
        progress.step += 1
        if progress.step % cfg.log_every == 0 or progress.step == 1:
            parts = []
            for name, rows in history.items():
                row = rows[-1].tolist()
                parts.append(f"{name} loss {row[0]:.3f} acc " + " ".join(f"{a:.2f}" for a in row[1:]))
            log("heads", f"step {progress.step}/{cfg.steps} " + " | ".join(parts)
                + f" {progress.elapsed_s:.0f}s")
    metrics = {"config": asdict(cfg), "steps_run": progress.step,
               "stopped_by_clock": progress.stopped_by_clock,
               "loop_seconds": round(progress.elapsed_s, 1)}
    for name, rows in history.items():
        metrics[name] = head_loss_summary(torch.stack(rows).cpu()[:, 0].tolist())
    for set_name, seqs in eval_sets.items():
        batches = list(seqs.split(max(1, cfg.batch_size // 2)))
        for name, values in evaluate(heads, target, embed, batches, cfg, spec, mask_id).items():
            metrics[name][set_name] = values
    metrics["seconds"] = round(time.monotonic() - started, 1)
    for name in heads:
        log("heads", f"{name}: loss {metrics[name]['first_loss']} -> {metrics[name]['final_loss']}; "
            f"val_generated {metrics[name]['val_generated']}; val_corpus {metrics[name]['val_corpus']}")
    return heads, metrics
