"""Shapes and `config.json` contents of the tiny target and its draft heads.

Owns: `TinySpec` (every size in one frozen dataclass), the target's Llama config,
its generation config, and the EAGLE-3 / P-EAGLE head configs in the form vLLM 0.32
loads (`vllm/model_executor/models/llama_eagle3.py`, `vllm/config/speculative.py`).

Knows nothing about weights, torch, files on disk or how the tokenizer is trained;
it only needs the special-token ids, which are fixed by `models.tokenizer`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from models.tokenizer import (
    BOS_TOKEN,
    END_TOKEN,
    EOS_TOKEN,
    MASK_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKEN_IDS,
)

# The architecture names vLLM 0.32 maps to Eagle3LlamaForCausalLM (model registry):
# LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM, PeagleLlamaForCausalLM,
# PEagleDraftModel. Parallel drafting is switched on by the speculative config
# (`parallel_drafting: true`), not by the architecture name.
HEAD_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class TinySpec:
    """Sizes of the tiny target (Llama) and of its one-layer draft heads."""

    vocab_size: int = 4096  # includes the 8 special tokens; a multiple of 64
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 704
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # Target layers the heads tap. Id i is the residual stream ENTERING layer i
    # (i == num_hidden_layers: after the last layer, before the final norm).
    # vLLM de-duplicates and sorts these ids, so they must be 3 distinct values or
    # the head's fc (3·H inputs) no longer matches the hidden states it is given.
    aux_layer_ids: tuple[int, ...] = (1, 2, 3)
    draft_vocab_size: int = 4096  # == vocab_size: no d2t mapping needed
    # Decoder layers per head. EAGLE-3 drafts one token per pass, so one layer
    # suffices. P-EAGLE's mask slots (draft positions 2..K) all read the same
    # constant input; with one layer each is a single attention hop over the
    # context, and a trained one-layer head almost never got position 3 accepted.
    # More layers let slot d read what earlier layers made of slots < d.
    head_num_hidden_layers: int = 1
    peagle_head_num_hidden_layers: int = 3

    def __post_init__(self) -> None:
        if self.vocab_size % 64 != 0:
            raise ValueError(f"vocab_size must be a multiple of 64, got {self.vocab_size!r}")
        if self.num_attention_heads * self.head_dim != self.hidden_size:
            raise ValueError(
                "num_attention_heads * head_dim must equal hidden_size, got "
                f"{self.num_attention_heads} * {self.head_dim} != {self.hidden_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_key_value_heads must divide num_attention_heads, got "
                f"{self.num_key_value_heads!r}"
            )
        ids = self.aux_layer_ids
        if len(set(ids)) != len(ids) or not all(
            0 <= i <= self.num_hidden_layers for i in ids
        ):
            raise ValueError(
                f"aux_layer_ids must be distinct ids in [0, {self.num_hidden_layers}], "
                f"got {ids!r}"
            )
        for name in ("head_num_hidden_layers", "peagle_head_num_hidden_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.draft_vocab_size != self.vocab_size:
            # A smaller draft vocab needs a d2t table that this builder does not make.
            raise ValueError(
                f"draft_vocab_size must equal vocab_size ({self.vocab_size}), "
                f"got {self.draft_vocab_size!r}"
            )

    def num_head_layers(self, parallel_drafting: bool) -> int:
        """Decoder layers of the P-EAGLE head (parallel_drafting) or the EAGLE-3 head."""
        return self.peagle_head_num_hidden_layers if parallel_drafting else self.head_num_hidden_layers

    @property
    def num_aux_hidden_states(self) -> int:
        return len(self.aux_layer_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TinySpec":
        """From `to_dict()`'s form (JSON turns the aux_layer_ids tuple into a list)."""
        d = dict(d)
        if "aux_layer_ids" in d:
            d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)


def _llama_common(spec: TinySpec) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "torch_dtype": "float32",  # pre-5.0 transformers reads this name
        "use_cache": True,
        "bos_token_id": SPECIAL_TOKEN_IDS[BOS_TOKEN],
        "eos_token_id": SPECIAL_TOKEN_IDS[EOS_TOKEN],
        "pad_token_id": SPECIAL_TOKEN_IDS[PAD_TOKEN],
    }


def target_config(spec: TinySpec) -> dict:
    """`config.json` of the target: a plain `LlamaForCausalLM`."""
    return {
        **_llama_common(spec),
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": spec.num_hidden_layers,
    }


def generation_config() -> dict:
    """`generation_config.json`: generation stops at `<|eos|>` or at a turn's `<|end|>`."""
    return {
        "bos_token_id": SPECIAL_TOKEN_IDS[BOS_TOKEN],
        "eos_token_id": [SPECIAL_TOKEN_IDS[EOS_TOKEN], SPECIAL_TOKEN_IDS[END_TOKEN]],
        "pad_token_id": SPECIAL_TOKEN_IDS[PAD_TOKEN],
        "do_sample": False,
    }


def head_config(spec: TinySpec, parallel_drafting: bool) -> dict:
    """`config.json` of an EAGLE-3 head; with parallel_drafting, a P-EAGLE head.

    The head shares the target's token embedding (no `embed_tokens` in its weights).
    P-EAGLE needs the mask token id: vLLM reads the first of `mask_token_id`,
    `pard_token`, `ptd_token_id` from the head config.
    """
    config = {
        **_llama_common(spec),
        "architectures": [HEAD_ARCHITECTURE],
        "num_hidden_layers": spec.num_head_layers(parallel_drafting),
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }
    if parallel_drafting:
        config["mask_token_id"] = SPECIAL_TOKEN_IDS[MASK_TOKEN]
    return config
