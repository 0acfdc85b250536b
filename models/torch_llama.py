"""A minimal torch Llama with the math of Hugging Face `LlamaForCausalLM`, for training.

Owns: the building blocks (RMSNorm, rotary embedding, grouped-query attention with
an optional boolean mask, SwiGLU MLP), the tiny target model whose `state_dict()`
keys are exactly the Hugging Face names (`model.layers.0.self_attn.q_proj.weight`,
..., `lm_head.weight`), its auxiliary hidden states (id i = the residual stream
ENTERING layer i, vLLM's convention), and cache-free greedy generation.

Knows nothing about files, tokenizers, vLLM or training loops. Needs only `torch`
(it runs on the GPU machine, which has no venv). `models.spec` is imported for
`TinySpec` only; it pulls in no third-party package.

Math mirrors `transformers/models/llama/modeling_llama.py`: RMSNorm in float32 then
cast back, rotate-half RoPE with `inv_freq = 1 / theta^(2i/d)`, K/V heads repeated
to the query heads in order (head h reads KV head h // n_rep), scale 1/sqrt(d).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.spec import TinySpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos/sin [..., head_dim] for integer positions of any shape (float32)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D]; cos/sin [S, D] or [B, S, D]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


class Attention(nn.Module):
    """Llama attention; `in_size` is H for the target and 2·H for an EAGLE-3 midlayer."""

    def __init__(self, spec: TinySpec, in_size: int) -> None:
        super().__init__()
        self.spec = spec
        d, nq, nkv = spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads
        self.q_proj = nn.Linear(in_size, nq * d, bias=False)
        self.k_proj = nn.Linear(in_size, nkv * d, bias=False)
        self.v_proj = nn.Linear(in_size, nkv * d, bias=False)
        self.o_proj = nn.Linear(nq * d, spec.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """q [B, nq, S, D] and k, v [B, nq, S, D] (KV heads already repeated)."""
        spec = self.spec
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, spec.num_attention_heads, spec.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, spec.num_key_value_heads, spec.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, spec.num_key_value_heads, spec.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, spec.head_dim, spec.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = spec.num_attention_heads // spec.num_key_value_heads
        return q, k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)

    def attend(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """mask: None for plain causal, else bool [Sq, Sk] (True = may attend)."""
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x, positions, mask=None):
        q, k, v = self.qkv(x, positions)
        return self.attend(q, k, v, mask)


class MLP(nn.Module):
    def __init__(self, spec: TinySpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: TinySpec, attn_in: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, attn_in or spec.hidden_size)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, positions, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, spec: TinySpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class TinyLlama(nn.Module):
    """The target. `state_dict()` keys are the Hugging Face `LlamaForCausalLM` names."""

    def __init__(self, spec: TinySpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = _Body(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def init_weights(self, seed: int) -> None:
        """GPT-2 style: N(0, 0.02), residual-writing projections scaled by 1/sqrt(2L)."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / (2 * self.spec.num_hidden_layers) ** 0.5
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                    continue
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, input_ids: torch.Tensor, aux_layer_ids: tuple[int, ...] = (),
                last_only: bool = False):
        """logits [B, S, V] (last_only: [B, 1, V]) and, if asked, aux hidden states
        concatenated [B, S, n·H] in sorted id order (vLLM sorts and de-duplicates
        them the same way)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        wanted = sorted(set(aux_layer_ids))
        aux = []
        for i, layer in enumerate(self.model.layers):
            if i in wanted:
                aux.append(x)
            x = layer(x, positions)
        if len(self.model.layers) in wanted:
            aux.append(x)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.model.norm(x))
        return logits, (torch.cat(aux, dim=-1) if aux else None)


@torch.no_grad()
def greedy_generate(model: TinyLlama, prompts: torch.Tensor, num_new_tokens: int,
                    banned_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [B, S] → [B, S + num_new_tokens].

    Cache-free (each step re-runs the whole sequence): the tiny model makes this
    cheap enough for a pool of training sequences and keeps one code path.
    `banned_ids` (special tokens) are never chosen.
    """
    seqs = prompts
    for _ in range(num_new_tokens):
        logits, _ = model(seqs, last_only=True)
        last = logits[:, -1].float()
        if banned_ids:
            last[:, list(banned_ids)] = float("-inf")
        seqs = torch.cat([seqs, last.argmax(-1, keepdim=True)], dim=1)
    return seqs
