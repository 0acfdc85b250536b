"""Random, reproducible initial weights for the tiny target and its draft heads.

Owns: the tensor names and shapes each checkpoint must hold (Hugging Face Llama names
for the target; the EAGLE-3 names that `llama_eagle3.py`'s `load_weights` expects for
the heads) and the initialization that makes the untrained target decisive.

Knows nothing about files, tokenizers or vLLM. Uses numpy only (no torch), so the
build stays fast; each tensor gets its own generator derived from (seed, name), so a
tensor's values do not depend on which other tensors exist or their order.

Why the init looks the way it does: tests compare greedy outputs with and without
speculation token for token. Batched verification changes float32 summation order,
so logits move by ~1e-5; a near-tie between the top two tokens would then flip the
argmax. The LM heads are therefore scaled so logits have a spread of `LOGIT_STD`
(the top-1/top-2 gap is then typically several units), and special-token rows are
zero so an untrained model never emits `<|eos|>`, `<|mask|>` or chat markers (its
generations always run to max_tokens).
"""

from __future__ import annotations

import hashlib

import numpy as np

from models.spec import TinySpec
from models.tokenizer import SPECIAL_TOKEN_IDS

LOGIT_STD = 16.0  # std of a logit given a unit-RMS final hidden state


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([seed, int.from_bytes(digest[:8], "little")]))
    )


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    values = _rng(seed, name).standard_normal(shape, dtype=np.float32)
    return np.ascontiguousarray(values * np.float32(std))


def _ones(n: int) -> np.ndarray:
    return np.ones((n,), dtype=np.float32)


def _lm_head(seed: int, name: str, spec: TinySpec, num_rows: int) -> np.ndarray:
    weight = _normal(seed, name, (num_rows, spec.hidden_size), LOGIT_STD / spec.hidden_size**0.5)
    weight[list(SPECIAL_TOKEN_IDS.values())] = 0.0
    return weight


def _decoder_layer(
    seed: int, key: str, prefix: str, spec: TinySpec, qkv_in: int, num_layers: int
) -> dict[str, np.ndarray]:
    """One Llama decoder layer; qkv_in is H for the target, 2·H for an EAGLE-3 midlayer.

    Linear layers use std 1/sqrt(fan_in); the two projections that write into the
    residual stream are further scaled by 1/sqrt(2·num_layers) (GPT-2 style) so the
    current token's embedding stays the strongest signal and context modulates it.
    """
    h, i = spec.hidden_size, spec.intermediate_size
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.num_key_value_heads * spec.head_dim
    residual_scale = (2 * num_layers) ** -0.5

    def linear(name: str, out_dim: int, in_dim: int, scale: float = 1.0) -> np.ndarray:
        return _normal(seed, f"{key}/{prefix}{name}", (out_dim, in_dim), scale / in_dim**0.5)

    return {
        f"{prefix}input_layernorm.weight": _ones(h),
        f"{prefix}post_attention_layernorm.weight": _ones(h),
        f"{prefix}self_attn.q_proj.weight": linear("self_attn.q_proj.weight", q_out, qkv_in),
        f"{prefix}self_attn.k_proj.weight": linear("self_attn.k_proj.weight", kv_out, qkv_in),
        f"{prefix}self_attn.v_proj.weight": linear("self_attn.v_proj.weight", kv_out, qkv_in),
        f"{prefix}self_attn.o_proj.weight": linear(
            "self_attn.o_proj.weight", h, q_out, residual_scale
        ),
        f"{prefix}mlp.gate_proj.weight": linear("mlp.gate_proj.weight", i, h),
        f"{prefix}mlp.up_proj.weight": linear("mlp.up_proj.weight", i, h),
        f"{prefix}mlp.down_proj.weight": linear("mlp.down_proj.weight", h, i, residual_scale),
    }


def target_weights(spec: TinySpec, seed: int) -> dict[str, np.ndarray]:
    """Hugging Face `LlamaForCausalLM` tensors (`model.*`, `lm_head.weight`)."""
    key = "target"
    tensors = {
        "model.embed_tokens.weight": _normal(
            seed, f"{key}/model.embed_tokens.weight", (spec.vocab_size, spec.hidden_size), 1.0
        ),
        "model.norm.weight": _ones(spec.hidden_size),
        "lm_head.weight": _lm_head(seed, f"{key}/lm_head.weight", spec, spec.vocab_size),
    }
    for layer in range(spec.num_hidden_layers):
        tensors.update(
            _decoder_layer(
                seed, key, f"model.layers.{layer}.", spec, spec.hidden_size, spec.num_hidden_layers
            )
        )
    return tensors


def head_weights(spec: TinySpec, seed: int, parallel_drafting: bool) -> dict[str, np.ndarray]:
    """EAGLE-3 head tensors; with parallel_drafting also `mask_hidden` (P-EAGLE).

    Names as vLLM's `Eagle3LlamaForCausalLM.load_weights` reads them: `midlayer.*`
    (renamed to `layers.0.*`; its q/k/v read 2·H = embedding ⊕ hidden, and it has an
    extra `hidden_norm`), further layers `layers.<i>.*` (plain Llama layers, q/k/v
    read H), `fc.weight` [H, n_aux·H_target], `norm.weight`, `lm_head.weight`
    [draft_vocab, H], `mask_hidden` [1, n_aux·H_target]. No `embed_tokens`: vLLM then
    shares the target's. No `d2t`: the draft vocab equals the target's. The P-EAGLE
    and EAGLE-3 heads share every tensor they both have.
    """
    key = "head"
    h = spec.hidden_size
    fc_in = spec.num_aux_hidden_states * spec.hidden_size
    num_layers = spec.num_head_layers(parallel_drafting)
    tensors = _decoder_layer(seed, key, "midlayer.", spec, 2 * h, num_layers)
    tensors["midlayer.hidden_norm.weight"] = _ones(h)
    for layer in range(1, num_layers):
        tensors.update(_decoder_layer(seed, key, f"layers.{layer}.", spec, h, num_layers))
    tensors["fc.weight"] = _normal(seed, f"{key}/fc.weight", (h, fc_in), fc_in**-0.5)
    tensors["norm.weight"] = _ones(h)
    tensors["lm_head.weight"] = _lm_head(seed, f"{key}/lm_head.weight", spec, spec.draft_vocab_size)
    if parallel_drafting:
        tensors["mask_hidden"] = _normal(seed, f"{key}/mask_hidden", (1, fc_in), 1.0)
    return tensors
