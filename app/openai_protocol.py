"""The OpenAI-compatible request schemas, error bodies and response shapes.

Requests are validated strictly: unknown fields and values we cannot honour (n > 1, logprobs, ...)
are a 400 naming the field, never silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator
from starlette.responses import JSONResponse


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 405: "invalid_request_error",
            503: "service_unavailable"}.get(status, "server_error")  # fmt: skip
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None
    ignore_eos: StrictBool = False  # vLLM-compatible extension (benchmarks): generate max_tokens regardless
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def sampling(self) -> dict[str, Any]:
        """Sampling fields for the replica; max_tokens None = the endpoint's default, which the
        replica fits to the room the prompt leaves."""
        return dict(max_tokens=self.max_tokens, temperature=self.temperature,
                    top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=tuple(self.stop or ()),
                    ignore_eos=self.ignore_eos)  # fmt: skip


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt]
    echo: Literal[False] = False
    logprobs: None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int]) -> str | list[int]:
        if not v:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: Literal[False] | None = None

    def sampling(self) -> dict[str, Any]:
        fields = super().sampling()
        fields["max_tokens"] = self.max_completion_tokens or fields["max_tokens"]
        return fields


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


class ResponseShape:
    """Builds the JSON of one completion or chat completion, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {**self._base(self.object), "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str, finish_reason: str | None, first: bool = False) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
