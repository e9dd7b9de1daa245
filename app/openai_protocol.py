"""The OpenAI-compatible request schemas, error bodies and response shapes.

Requests are validated strictly: unknown fields and values we cannot honour (n > 1, logprobs, tools,
a JSON response format, ...) are a 400 naming the field, never silently ignored, and every field
takes only its own JSON type (no "1.5" for a number, no true for 1, no number for a string). Fields
that do not change what is generated (store, metadata, user, service_tier, parallel_tool_calls) are
accepted and have no effect.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse

STOP_MAX_CHARS = 512  # the longest stop string accepted (characters); the README's API section says so
STRICT = ConfigDict(extra="forbid", strict=True)  # strict: no lax coercion ("1.5" -> 1.5, true -> 1)


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error JSON (also the last event of a stream that failed)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 405: "invalid_request_error",
            503: "service_unavailable"}.get(status, "server_error")  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _json_type(expected: str, *types: type) -> BeforeValidator:
    """Checks the JSON type before a Literal's equality test, which lets true pass for 1 and 0 for false."""

    def check(value: Any) -> Any:
        if type(value) not in types:
            raise PydanticCustomError("json_type", "Input should be {expected}", {"expected": expected})
        return value

    return BeforeValidator(check)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = STRICT

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # strict floats take ints too
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(0, ge=0)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[Literal[1], _json_type("an integer", int)] = 1
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # vLLM-compatible extension (benchmarks): generate max_tokens regardless
    presence_penalty: Annotated[Literal[0, 0.0], _json_type("a number", int, float)] = 0.0
    frequency_penalty: Annotated[Literal[0, 0.0], _json_type("a number", int, float)] = 0.0
    # accepted, and they change nothing that is generated
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    service_tier: StrictStr | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        if any(len(s) > STOP_MAX_CHARS for s in stops):
            raise ValueError(f"a stop string may be at most {STOP_MAX_CHARS} characters long")
        return stops

    def sampling(self) -> dict[str, Any]:
        """Sampling fields for the replica; max_tokens None = the endpoint's default, which the
        replica fits to the room the prompt leaves."""
        return dict(max_tokens=self.max_tokens, temperature=self.temperature,
                    top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=tuple(self.stop or ()),
                    ignore_eos=self.ignore_eos)  # fmt: skip


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictInt]
    echo: Annotated[Literal[False], _json_type("a boolean", bool)] = False
    logprobs: None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int]) -> str | list[int]:
        if not v:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this model reads text only")
        return v

    def for_template(self) -> dict[str, str]:
        """The message as a chat template reads it: text parts joined, `developer` (OpenAI's newer
        name for system instructions) as `system`."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return {**out, "name": self.name} if self.name is not None else out


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]  # json_object and json_schema would need constrained decoding: refused


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: Annotated[Literal[False] | None, _json_type("a boolean or null", bool, type(None))] = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: StrictBool | None = None  # meaningless without tools, which are refused
    tools: None = None
    tool_choice: None = None

    @field_validator("tools", "tool_choice", mode="before")
    @classmethod
    def _no_tools(cls, v: Any) -> None:
        if v is not None:
            raise ValueError("tool calling is not supported")
        return v

    @field_validator("response_format", mode="before")
    @classmethod
    def _text_format(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "text":
            raise ValueError(f"response_format {v.get('type')!r} is not supported (it needs constrained decoding); "
                             'only {"type": "text"}')  # fmt: skip
        return v

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
