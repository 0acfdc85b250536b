"""The tiny models' tokenizer: a byte-level BPE trained on local Python source.

Owns: the special tokens and their fixed ids, the training corpus (the interpreter's
own standard library, read in sorted order up to a byte budget, so the same machine
always trains the same merges), the BPE training itself, the chat template, and
writing the Hugging Face fast-tokenizer files (`tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`) into a model directory.

Knows nothing about model weights, model configs or vLLM. A later training step
reuses `train_tokenizer()` / `save_tokenizer()` unchanged and only writes new weights.

Conventions a user of these models must know:
- The tokenizer never adds special tokens by itself (no post-processor), so
  `decode(encode(x)) == x` for any text, and raw completion prompts carry no BOS.
- The chat template is the one place `<|bos|>` appears: it starts the rendered chat.
  A chat rendered with the template and tokenized with the default
  `add_special_tokens=True` (Ray Data's tokenize stage does this) therefore gets
  exactly one BOS, the same as vLLM's own chat path.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Order fixes the ids: the BPE trainer gives special tokens the first ids, in order.
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
MASK_TOKEN = "<|mask|>"  # the P-EAGLE mask token (draft positions 2..K)
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
END_TOKEN = "<|end|>"  # ends one chat turn
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    MASK_TOKEN,
    SYSTEM_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    END_TOKEN,
)
SPECIAL_TOKEN_IDS: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
CHAT_MARKERS: tuple[str, ...] = (SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_TOKEN)

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_CORPUS_MAX_BYTES = 8_000_000  # ~1 s to read and ~1 s to train on 2 cores
MODEL_MAX_LENGTH = 2048

# Roles map onto the marker tokens; any other role is an error, not a silent pass.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def stdlib_source_files(stdlib_dir: Path | None = None) -> list[Path]:
    """The standard library's `.py` files in sorted relative-path order.

    `site-packages` lives under the stdlib directory but changes with every pip
    install, so it is excluded to keep the corpus (and the merges) reproducible.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory not found: {str(root)!r}")
    rel_paths = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "site-packages" not in p.relative_to(root).parts and p.is_file()
    )
    return [root / rel for rel in rel_paths]


def iter_corpus(
    max_bytes: int = DEFAULT_CORPUS_MAX_BYTES, stdlib_dir: Path | None = None
) -> Iterator[str]:
    """Yield whole stdlib source files, in order, until the next would pass max_bytes.

    Files that are not valid UTF-8 are skipped (a handful of encoding tests).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes!r}")
    num_bytes = 0
    for path in stdlib_source_files(stdlib_dir):
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        size = len(text.encode("utf-8"))
        if num_bytes + size > max_bytes:
            return
        num_bytes += size
        yield text


def train_tokenizer(
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    corpus_max_bytes: int = DEFAULT_CORPUS_MAX_BYTES,
    stdlib_dir: Path | None = None,
):
    """Train the byte-level BPE; returns a `tokenizers.Tokenizer`.

    vocab_size counts the special tokens and the 256 byte symbols; it must be a
    multiple of 64 so the embedding and LM head shapes stay friendly to kernels.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size % 64 != 0 or vocab_size < 512:
        raise ValueError(
            f"vocab_size must be a multiple of 64 and at least 512, got {vocab_size!r}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=True
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(
        iter_corpus(corpus_max_bytes, stdlib_dir), trainer=trainer
    )
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"BPE training reached {tokenizer.get_vocab_size()} tokens, wanted "
            f"{vocab_size}; raise corpus_max_bytes (got {corpus_max_bytes!r})"
        )
    for token, token_id in SPECIAL_TOKEN_IDS.items():
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token!r} did not get id {token_id}")
    return tokenizer


def tokenizer_config() -> dict:
    """The `tokenizer_config.json` contents (also read by vLLM and Ray Data)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "additional_special_tokens": list(CHAT_MARKERS),
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,  # else " ." decodes to "."
        "add_bos_token": False,
        "add_eos_token": False,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "additional_special_tokens": list(CHAT_MARKERS),
    }


def write_json(path: Path, obj: dict) -> None:
    """Stable bytes: sorted keys, fixed indent, trailing newline."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_tokenizer(tokenizer, model_dir: Path) -> None:
    """Write the HF fast-tokenizer files into model_dir (created if missing)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "tokenizer.json").write_text(
        tokenizer.to_str(pretty=True) + "\n", encoding="utf-8"
    )
    write_json(model_dir / "tokenizer_config.json", tokenizer_config())
    write_json(model_dir / "special_tokens_map.json", special_tokens_map())
