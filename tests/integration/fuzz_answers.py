"""How the fuzz tests judge an answer of the OpenAI door (tests/integration/test_fuzz.py
in process, test_serving.py through Serve): a 200 must answer every choice asked (a
stream: to its [DONE], with usage when asked); a 4xx needs an OpenAI error body and a
request broken on purpose, or one of the refusals vLLM makes on purpose
(`ALLOWED_REFUSALS`, each with its reason); nothing else passes."""

from __future__ import annotations

import json
from typing import Any

import httpx

from fuzz_requests import Fuzzed


def _spec_refuses(method: str, body: dict[str, Any]) -> bool:
    return method != "none" and ((body.get("min_p") or 0) > 0 or bool(body.get("logit_bias")))


def _greedy_with_n(method: str, body: dict[str, Any]) -> bool:
    temperature = body.get("temperature")
    return temperature is not None and temperature < 1e-5 and (body.get("n") or 1) > 1


# Valid-looking combinations vLLM refuses on purpose: (name, applies(method, body), a
# substring of vLLM's message, why). A valid request matching one may get a 400 with
# that message; any other refusal of a valid request is a failure.
ALLOWED_REFUSALS = [
    ("min_p or logit_bias under speculation", _spec_refuses, "not yet supported with speculative decoding",
     "vllm/sampling_params.py SamplingParams._validate_spec_decode: vLLM 0.32's rejection sampler "
     "applies neither, so it refuses them on an engine with a speculative config"),
    ("n > 1 with temperature 0", _greedy_with_n, "n must be 1 when using greedy sampling",
     "vllm/sampling_params.py SamplingParams._verify_greedy_sampling: n greedy samples would all be "
     "the same text (OpenAI itself accepts it and returns n copies)"),
]


def allowed_refusal(method: str, body: dict[str, Any], message: str) -> str | None:
    for name, applies, text, _why in ALLOWED_REFUSALS:
        if applies(method, body) and text in message:
            return name
    return None


def _choices_wanted(body: dict[str, Any]) -> int:
    n = body.get("n", 1)
    return n if isinstance(n, int) and n > 0 else 1


def check_json_answer(case: Fuzzed, data: dict[str, Any]) -> list[str]:
    """What is wrong with a 200 answer's body."""
    choices = data.get("choices") or []
    finished = sorted(c["index"] for c in choices if c.get("finish_reason"))
    if finished != list(range(_choices_wanted(case.body))):
        return [f"choices with a finish_reason {finished}, asked n={case.body.get('n', 1)}"]
    return []


def stream_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def stream_error(text: str) -> dict[str, Any] | None:
    """The first error event of a stream (vLLM sends one, then [DONE], when a request
    fails after its 200 was sent)."""
    for event in stream_events(text):
        if event != "[DONE]" and "error" in (chunk := json.loads(event)):
            return chunk["error"]
    return None


def check_stream(case: Fuzzed, text: str) -> list[str]:
    """What is wrong with a 200 server-sent-event stream without an error event."""
    events = stream_events(text)
    if not events or events[-1] != "[DONE]":
        return [f"stream did not end with data: [DONE] (last event {events[-1:]!r})"]
    finished, usage = set(), None
    for event in events[:-1]:
        chunk = json.loads(event)
        finished |= {c["index"] for c in chunk.get("choices") or [] if c.get("finish_reason")}
        usage = chunk.get("usage") or usage
    problems = []
    if sorted(finished) != list(range(_choices_wanted(case.body))):
        problems.append(f"streamed choices with a finish_reason {sorted(finished)}, asked n={case.body.get('n', 1)}")
    if (case.body.get("stream_options") or {}).get("include_usage") and usage is None:
        problems.append("include_usage asked, no usage chunk")
    return problems


async def send_http(client: httpx.AsyncClient, method: str, case: Fuzzed) -> tuple[str, list[str]]:
    """(status label, problems) of one OpenAI request."""
    async with client.stream("POST", case.path, json=case.body) as response:
        raw = await response.aread()
    status, text = response.status_code, raw.decode("utf-8", "replace")
    if status >= 500:
        return str(status), [f"{status}: {text[:500]}"]
    if status == 200 and case.body.get("stream") and (error := stream_error(text)) is not None:
        # The status line is already sent: a refusal here is not a 4xx, a failure not a 5xx.
        code, message = error.get("code"), str(error.get("message"))
        if not isinstance(code, int) or code >= 500:
            kind = "engine failure"
        elif case.invalid is not None:
            kind = f"refusal of broken {case.invalid!r}"
        else:
            kind = f"refusal ({allowed_refusal(method, case.body, message) or 'not allow-listed'})"
        return f"200+error {code}", [f"{kind} sent as an error event in a 200 stream: {json.dumps(error)[:300]}"]
    if status == 200:
        if case.invalid is not None:
            return "200", [f"broken {case.invalid!r} was served (200)"]
        problems = check_stream(case, text) if case.body.get("stream") else check_json_answer(case, json.loads(text))
        return "200", problems
    try:
        message = json.loads(text)["error"]["message"]
        assert isinstance(message, str) and message
    except (ValueError, KeyError, TypeError, AssertionError):
        return str(status), [f"{status} without an OpenAI error body: {text[:300]}"]
    if status not in (400, 422):
        return str(status), [f"unexpected {status}: {message[:300]}"]
    if case.invalid is not None:
        return str(status), []
    allowed = allowed_refusal(method, case.body, message)
    if allowed is not None:
        return f"{status} allowed", []
    return str(status), [f"valid request refused {status}: {message[:300]}"]
