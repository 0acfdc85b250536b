"""The EAGLE-3 / P-EAGLE draft head in torch, with vLLM 0.32's math, for training.

Owns: the head's parameters under the checkpoint names `llama_eagle3.py` loads
(`midlayer.*` with its extra `hidden_norm`, further layers `layers.<i>.*`,
`fc.weight` [H, 3·H], `norm.weight`, `lm_head.weight`, and for P-EAGLE `mask_hidden`
[1, 3·H]); one head step over a set of draft "slots"; and the slot attention mask.

The math, as vLLM runs it (`Eagle3LlamaForCausalLM`):
    residual = hidden                       # fc(aux) for real slots, fc(mask_hidden)
    x = cat(input_layernorm(embed), hidden_norm(hidden))   # layer 0: 2·H into q/k/v
    residual = residual + o_proj(attn(x));  residual = residual + mlp(post_ln(residual))
    layers i ≥ 1: plain pre-norm Llama layers on `residual`
    logits = lm_head(norm(residual));  `residual` (pre-norm) is the hidden an
    autoregressive EAGLE-3 step feeds back (H wide, NOT through fc again).

A slot is (anchor a, depth d): it sits at position a + d and predicts the target's
distribution at position a + d + 1. Depth 0 is real (token x[a+1], hidden from the
target at a). The slot mask lets (a, d) see depth-0 slots at anchors ≤ a and the
slots of its own anchor with depth ≤ d: exactly the keys a vLLM draft pass finds in
its KV cache. The token embedding is the target's (shared, frozen, not saved).

Knows nothing about data, losses, files or vLLM. Needs only torch.
"""

from __future__ import annotations

import torch
from torch import nn

from models.spec import TinySpec
from models.torch_llama import DecoderLayer, RMSNorm, TinyLlama


class MidLayer(DecoderLayer):
    def __init__(self, spec: TinySpec) -> None:
        super().__init__(spec, attn_in=2 * spec.hidden_size)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


def slot_mask(q_anchor, q_depth, k_anchor, k_depth) -> torch.Tensor:
    """bool [Q, K]: True where query slot (a, d) may attend key slot (a', d')."""
    qa, qd = q_anchor[:, None], q_depth[:, None]
    ka, kd = k_anchor[None, :], k_depth[None, :]
    return ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd))


class EagleHead(nn.Module):
    def __init__(self, spec: TinySpec, parallel_drafting: bool) -> None:
        super().__init__()
        self.spec = spec
        fc_in = spec.num_aux_hidden_states * spec.hidden_size
        self.midlayer = MidLayer(spec)
        # Checkpoint names `layers.1.*`, `layers.2.*`, ... (`midlayer` is layer 0).
        self.layers = nn.ModuleDict({str(i): DecoderLayer(spec)
                                     for i in range(1, spec.num_head_layers(parallel_drafting))})
        self.fc = nn.Linear(fc_in, spec.hidden_size, bias=False)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
        self.mask_hidden = nn.Parameter(torch.zeros(1, fc_in)) if parallel_drafting else None

    def init_from_target(self, target: TinyLlama, seed: int, aux_rms: float) -> None:
        """Random midlayer/fc; lm_head and final norm copied from the target (the head
        starts by reading out the target's vocabulary); mask_hidden ~ N(0, aux_rms²)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif name == "mask_hidden":
                    p.copy_(torch.randn(p.shape, generator=gen) * aux_rms)
                elif name.startswith(("midlayer.", "layers.")):
                    num_layers = 1 + len(self.layers)
                    std = 0.02 / (2 * num_layers) ** 0.5 if name.endswith(
                        ("o_proj.weight", "down_proj.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            self.fc.weight.copy_(torch.randn(self.fc.weight.shape, generator=gen) * self.fc.in_features**-0.5)
            self.lm_head.weight.copy_(target.lm_head.weight)
            self.norm.weight.copy_(target.model.norm.weight)

    def warm_start(self, source: dict[str, torch.Tensor]) -> None:
        """Copy a trained head's tensors in (same spec, same names). Every tensor of this
        head must be given except P-EAGLE's `mask_hidden`, which an EAGLE-3 head lacks and
        which keeps its `init_from_target` value; a tensor this head lacks is an error."""
        own = self.state_dict()
        may_keep = {"mask_hidden"}
        missing = sorted(set(own) - set(source) - may_keep)
        extra = sorted(set(source) - set(own))
        wrong = [f"{k}: {tuple(source[k].shape)} != {tuple(own[k].shape)}"
                 for k in own if k in source and source[k].shape != own[k].shape]
        if missing or extra or wrong:
            raise ValueError(f"the warm-start head does not fit this one: missing {missing!r}, "
                             f"unexpected {extra!r}, shapes {wrong!r}")
        self.load_state_dict(source, strict=False)  # only mask_hidden may be left out

    def new_kv_cache(self) -> list[list]:
        return [[] for _ in range(1 + len(self.layers))]

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor, kv_cache: list | None = None):
        """One pass of the head over new slots.

        embeds, hidden [B, S, H]; positions [S]; mask bool [S, S_cached + S].
        kv_cache (from `new_kv_cache`): per layer, the (k, v) of earlier passes (keys
        come first, in order); the new slots' (k, v) are appended.
        Returns (logits [B, S, V], prenorm [B, S, H]).
        """
        mid = self.midlayer
        residual = hidden
        for i, layer in enumerate([mid, *self.layers.values()]):
            if i == 0:
                x = torch.cat([mid.input_layernorm(embeds), mid.hidden_norm(hidden)], dim=-1)
            else:
                x = layer.input_layernorm(residual)
            q, k, v = layer.self_attn.qkv(x, positions)
            if kv_cache is not None:
                kv_cache[i].append((k, v))
                k = torch.cat([kk for kk, _ in kv_cache[i]], dim=2)
                v = torch.cat([vv for _, vv in kv_cache[i]], dim=2)
            residual = residual + layer.self_attn.attend(q, k, v, mask)
            residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return self.lm_head(self.norm(residual)), residual

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """float32 CPU tensors under the checkpoint names vLLM loads."""
        return {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
