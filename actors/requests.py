"""What one generation request may ask for, validated before it reaches an engine.

Owns the request/result shapes exchanged between pipelines, actors and (later) the
Serve app, as plain dicts on the wire. Validation names the bad value so a row's error
says exactly what was wrong. Knows nothing about vLLM: `actors.engine` maps a valid
request to `SamplingParams`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from configs.schema import SamplingDefaults

PRIORITY_ONLINE = 0
PRIORITY_BATCH = 1


class RequestError(ValueError):
    """A request that cannot be served as given; the message names the value."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class GenerationRequest(BaseModel):
    """One prompt (raw text or chat messages) and its sampling options. Unset options
    take the deployment's `SamplingDefaults`."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, description="Caller's id; results are matched by it.")
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Seeded sampling; a 64-bit "
                             "signed integer, as vLLM's OpenAI layer takes it.")
    ignore_eos: bool = Field(
        False, description="Keep generating past the end-of-sequence token until max_tokens "
        "(profiling and benchmarks that need a fixed output length; not for real work).")
    priority: int = Field(PRIORITY_BATCH, description="0 = online, 1 = batch; lower first.")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerationRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages must be given")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


def parse_request(data: dict[str, Any]) -> GenerationRequest:
    """Validate a request dict; raise `RequestError` naming each bad field and value."""
    try:
        return GenerationRequest.model_validate(data)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "request"
            got = f", got {err['input']!r}" if err["type"] != "missing" and where != "request" else ""
            parts.append(f"{where}: {err['msg']}{got}")
        raise RequestError("; ".join(parts)) from None


def resolved_sampling(req: GenerationRequest, defaults: SamplingDefaults) -> dict[str, Any]:
    """The sampling values a request runs with: its own, else the defaults."""
    return {
        "max_tokens": req.max_tokens if req.max_tokens is not None else defaults.max_tokens,
        "temperature": req.temperature if req.temperature is not None else defaults.temperature,
        "top_p": req.top_p if req.top_p is not None else defaults.top_p,
        "stop": req.stop if req.stop is not None else list(defaults.stop),
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
    }


def error_result(request_id: str, reason: str, message: str) -> dict[str, Any]:
    """A failed request, as the result dict every consumer understands."""
    return {"id": request_id, "ok": False, "error": {"reason": reason, "message": message}}
