"""Random but reproducible requests for the fuzz tests (tests/integration/test_fuzz.py).

Pure functions of a `random.Random`: the same seed gives the same requests. Each returns a
`Fuzzed`: the request body, the path it goes to (None for a batch row), and `invalid`:
None for a request that should be served, else which value was broken on purpose (the
expected answer is then a 4xx, or for a batch row an error with reason
"invalid_request"). About one request in ten is broken on purpose, one way at a time.

Covered on the OpenAI door (vLLM's own /v1/completions and /v1/chat/completions): seed,
temperature, top_p, top_k, min_p, n, best_of (completions), stop (a string or a list),
logprobs (completions: 0..5; chat: logprobs + top_logprobs 0..5), presence / frequency /
repetition penalties, logit_bias, min_tokens, max_tokens (or max_completion_tokens in
chat), ignore_eos, response_format (text, json_object, a small json_schema), vLLM's
structured_outputs (choice, regex), prompts as text or token ids, streaming with and
without usage. On the batch door (`Engine.generate`): every field of
`actors.requests.GenerationRequest` a caller sets. Output is bounded (max_tokens <= 24)
so a run stays short.
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

MAX_TOKENS = 24
INVALID_SHARE = 0.1
NUM_SPECIAL_TOKENS = 8  # the tiny tokenizer's ids 0..7 (pad, bos, eos, ...): prompts use the others

PROMPTS = [
    "def fib(n):",
    "import os\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "# sort a list of numbers\ndef sort(xs):\n",
    "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n",
    "for i in range(10):\n",
]
CHAT_QUESTIONS = [
    "Write a function that reverses a string.",
    "What does `yield` do in Python?",
    "def add(a, b):",
    "Give me a list comprehension for squares.",
]
STOPS = ["\n", "def", "return", ":", "  ", "```", "(", "x"]
TEMPERATURES = [0.0, 0.01, 0.7, 1.0, 1.5, 2.0]
TOP_PS = [0.1, 0.5, 0.9, 1.0]
TOP_KS = [-1, 1, 5, 50]
MIN_PS = [0.0, 0.05, 0.2]
JSON_SCHEMA = {
    "name": "answer",
    "schema": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["ok"],
    },
}
CHOICES = ["yes", "no", "maybe"]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EDGE_SEEDS = [0, -1, INT64_MAX, INT64_MIN]  # the OpenAI layer's own bounds on seed
REGEX = "[a-z]{1,6}( [0-9]{1,3})?"


class Fuzzed(NamedTuple):
    path: str | None  # /v1/completions, /v1/chat/completions; None for a batch row
    body: dict[str, Any]
    invalid: str | None  # what was broken on purpose; None = a valid request


def _maybe(rng: random.Random, p: float) -> bool:
    return rng.random() < p


def _seed(rng: random.Random) -> int:
    return rng.choice(EDGE_SEEDS) if _maybe(rng, 0.15) else rng.randrange(0, 2**31)


def _penalty(rng: random.Random) -> float:
    return round(rng.uniform(-2.0, 2.0), 2)


def _sampling(rng: random.Random, body: dict[str, Any], vocab_size: int) -> None:
    """The sampling fields both OpenAI routes share, each present about half the time."""
    if _maybe(rng, 0.5):
        body["seed"] = _seed(rng)
    if _maybe(rng, 0.8):
        body["temperature"] = rng.choice(TEMPERATURES)
    if _maybe(rng, 0.4):
        body["top_p"] = rng.choice(TOP_PS)
    if _maybe(rng, 0.4):
        body["top_k"] = rng.choice(TOP_KS)
    if _maybe(rng, 0.1):  # refused on a speculating engine: rare, so the other fields get the requests
        body["min_p"] = rng.choice(MIN_PS)
    if _maybe(rng, 0.35):
        body["n"] = rng.choice([1, 1, 2, 3])
    if _maybe(rng, 0.35):
        body["stop"] = rng.choice(STOPS) if _maybe(rng, 0.5) else rng.sample(STOPS, rng.randint(1, 3))
    if _maybe(rng, 0.3):
        body["presence_penalty"] = _penalty(rng)
    if _maybe(rng, 0.3):
        body["frequency_penalty"] = _penalty(rng)
    if _maybe(rng, 0.3):
        body["repetition_penalty"] = round(rng.uniform(0.5, 2.0), 2)
    if _maybe(rng, 0.1):  # refused on a speculating engine, as min_p
        ids = rng.sample(range(NUM_SPECIAL_TOKENS, vocab_size), rng.randint(1, 3))
        body["logit_bias"] = {str(i): rng.choice([-100, -5.5, 0, 3, 100]) for i in ids}
    if _maybe(rng, 0.3):
        body["ignore_eos"] = rng.choice([True, False])
    roll = rng.random()
    if roll < 0.08:
        body["response_format"] = {"type": "json_object"}
    elif roll < 0.14:
        body["response_format"] = {"type": "json_schema", "json_schema": JSON_SCHEMA}
    elif roll < 0.18:
        body["response_format"] = {"type": "text"}
    elif roll < 0.24:
        body["structured_outputs"] = {"choice": list(CHOICES)}
    elif roll < 0.30:
        body["structured_outputs"] = {"regex": REGEX}
    if _maybe(rng, 0.4):
        body["stream"] = True
        if _maybe(rng, 0.6):
            body["stream_options"] = {"include_usage": rng.choice([True, False])}


def _limits(rng: random.Random, body: dict[str, Any], max_field: str) -> None:
    body[max_field] = rng.randint(1, MAX_TOKENS)
    if _maybe(rng, 0.3):
        body["min_tokens"] = rng.randint(0, body[max_field])


def _break(rng: random.Random, body: dict[str, Any], max_field: str, vocab_size: int) -> str:
    """Break one value the OpenAI layer must refuse; returns which."""
    how = rng.choice(["temperature", "top_p", "n", "max_tokens", "logit_bias", "min_tokens",
                      "response_format"])
    if how == "temperature":
        body["temperature"] = -1.0
    elif how == "top_p":
        body["top_p"] = 0.0
    elif how == "n":
        body["n"] = 0
        body.pop("best_of", None)
    elif how == "max_tokens":
        body[max_field] = 0
        body.pop("min_tokens", None)
    elif how == "logit_bias":
        body["logit_bias"] = {str(vocab_size + rng.randrange(0, 1000)): 5.0}
    elif how == "min_tokens":
        body["min_tokens"] = body[max_field] + rng.randint(1, 8)
    else:
        body.pop("structured_outputs", None)
        body["response_format"] = {"type": "yaml_please"}
    return how


def completion_request(rng: random.Random, model: str, tokenizer_vocab_size: int) -> Fuzzed:
    """A /v1/completions request: text or token-id prompt, plus best_of and logprobs."""
    body: dict[str, Any] = {"model": model}
    if _maybe(rng, 0.4):
        body["prompt"] = [rng.randrange(NUM_SPECIAL_TOKENS, tokenizer_vocab_size) for _ in range(rng.randint(1, 12))]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    _limits(rng, body, "max_tokens")
    _sampling(rng, body, tokenizer_vocab_size)
    if _maybe(rng, 0.25):  # best_of >= n (vLLM 0.32's completions model has no such field; the door counts it)
        body["best_of"] = body.get("n", 1) + rng.randint(0, 2)
    if _maybe(rng, 0.35):
        body["logprobs"] = rng.randint(0, 5)
    invalid = _break(rng, body, "max_tokens", tokenizer_vocab_size) if _maybe(rng, INVALID_SHARE) else None
    return Fuzzed("/v1/completions", body, invalid)


def chat_request(rng: random.Random, model: str, tokenizer_vocab_size: int = 4096) -> Fuzzed:
    """A /v1/chat/completions request: a user turn (sometimes after a system turn and a
    previous exchange), logprobs as logprobs + top_logprobs."""
    messages = []
    if _maybe(rng, 0.3):
        messages.append({"role": "system", "content": "You write short Python."})
    if _maybe(rng, 0.2):
        messages += [{"role": "user", "content": rng.choice(CHAT_QUESTIONS)},
                     {"role": "assistant", "content": "def f():\n    pass"}]
    messages.append({"role": "user", "content": rng.choice(CHAT_QUESTIONS)})
    body: dict[str, Any] = {"model": model, "messages": messages}
    max_field = rng.choice(["max_tokens", "max_completion_tokens"])
    _limits(rng, body, max_field)
    _sampling(rng, body, tokenizer_vocab_size)
    if _maybe(rng, 0.35):
        body["logprobs"] = True
        body["top_logprobs"] = rng.randint(0, 5)
    invalid = _break(rng, body, max_field, tokenizer_vocab_size) if _maybe(rng, INVALID_SHARE) else None
    return Fuzzed("/v1/chat/completions", body, invalid)


def batch_row(rng: random.Random, i: int) -> Fuzzed:
    """A row for the batch door (`Engine.generate`, `actors.requests.GenerationRequest`)."""
    row: dict[str, Any] = {"id": f"row-{i}", "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, MAX_TOKENS)}
    if _maybe(rng, 0.7):
        row["temperature"] = rng.choice(TEMPERATURES)
    if _maybe(rng, 0.4):
        row["top_p"] = rng.choice(TOP_PS)
    if _maybe(rng, 0.4):
        row["stop"] = rng.choice(STOPS) if _maybe(rng, 0.5) else rng.sample(STOPS, rng.randint(1, 3))
    if _maybe(rng, 0.5):
        row["seed"] = _seed(rng)
    if _maybe(rng, 0.3):
        row["ignore_eos"] = rng.choice([True, False])
    if not _maybe(rng, INVALID_SHARE):
        return Fuzzed(None, row, None)
    how = rng.choice(["temperature", "top_p", "max_tokens", "stop", "seed", "prompt", "unknown_field"])
    if how == "temperature":
        row["temperature"] = rng.choice([-1.0, 2.5])
    elif how == "top_p":
        row["top_p"] = 0.0
    elif how == "max_tokens":
        row["max_tokens"] = 0
    elif how == "stop":
        row["stop"] = [""]  # vLLM's SamplingParams refuses an empty stop string
    elif how == "seed":
        row["seed"] = rng.choice([2**64, INT64_MIN - 1])  # wider than the 64 bits the engine core carries
    elif how == "prompt":
        del row["prompt"]
    else:
        row["top_k"] = 5  # not a batch-door field
    return Fuzzed(None, row, how)
