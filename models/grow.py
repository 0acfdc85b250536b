"""Depth growth of a trained target that leaves what it computes unchanged.

    grown = grow_depth(state, TinySpec(num_hidden_layers=16, aux_layer_ids=(4, 8, 12)), seed=0)

Owns: the map from an L-layer target's state dict to an (r·L)-layer one. Trained layer i
goes to position r·i. Each layer in between is new: its norms and its q/k/v/gate/up
projections are drawn as `TinyLlama.init_weights` draws them (seeded), and its o_proj
and down_proj are zero, so it adds nothing to the residual stream until training moves
those two. The grown model's logits therefore equal the trained one's, and the residual
stream entering position r·i equals the one that entered trained layer i: a head tapping
aux ids (1, 2, 3) of the 4-layer target sees the same states at (4, 8, 12) of the grown one.

Why: on this CPU a target step is per-layer overhead, so a deeper target is what makes a
one-layer head cheap beside it (docs/tiny-model.md), and training a deep target from
scratch here would take hundreds of CPU hours. A grown target starts where the trained
one stands, and the chunks of `models.train_chunks` (its `init_target` hook takes
`grow_for_plan`) make the new layers do work. Untrained, they only pad the step.

Knows nothing about files, heads or vLLM. Needs only torch.
"""

from __future__ import annotations

import torch

from models.spec import TinySpec
from models.torch_llama import TinyLlama

LAYER_PREFIX = "model.layers."
ZERO_INIT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def num_layers(state: dict[str, torch.Tensor]) -> int:
    """The decoder layers a target state dict holds."""
    ids = {int(k[len(LAYER_PREFIX):].split(".")[0]) for k in state if k.startswith(LAYER_PREFIX)}
    if not ids or ids != set(range(len(ids))):
        raise ValueError(f"state dict holds no layers 0..L-1 under {LAYER_PREFIX!r}: {sorted(ids)!r}")
    return len(ids)


def grow_depth(state: dict[str, torch.Tensor], to: TinySpec, seed: int) -> dict[str, torch.Tensor]:
    """state (an L-layer target) grown to `to.num_hidden_layers` = r·L layers; float32."""
    n_from, n_to = num_layers(state), to.num_hidden_layers
    if n_to < n_from or n_to % n_from:
        raise ValueError(f"num_hidden_layers must be a multiple of the trained target's {n_from}, "
                         f"got {n_to!r}")
    ratio = n_to // n_from
    fresh = TinyLlama(to)
    fresh.init_weights(seed)
    grown = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
    for key, value in state.items():
        if not key.startswith(LAYER_PREFIX):
            target_key = key
        else:
            layer, rest = key[len(LAYER_PREFIX):].split(".", 1)
            target_key = f"{LAYER_PREFIX}{int(layer) * ratio}.{rest}"
        if target_key not in grown or grown[target_key].shape != value.shape:
            raise ValueError(f"{key!r} {tuple(value.shape)} does not fit the grown spec "
                             f"({target_key!r} {tuple(grown.get(target_key, torch.empty(0)).shape)})")
        grown[target_key] = value.detach().to(torch.float32).clone()
    for i in range(n_to):
        if i % ratio:
            for name in ZERO_INIT:
                grown[f"{LAYER_PREFIX}{i}.{name}"].zero_()
    return grown


def grow_for_plan(plan, from_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`models.train_chunks.init_target`'s grow hook: the plan's spec, the plan's seed."""
    return grow_depth(from_state, plan.tiny_spec(), plan.seed)
