"""The OpenAI-compatible request schemas, error bodies and response shapes.

Requests are validated strictly: unknown fields and values we cannot honour (n > 16, tools, a JSON
schema the grammar engine cannot compile, ...) are a 400 naming the field, never silently ignored,
and every field takes only its own JSON type (no "1.5" for a number, no true for 1, no number for a string). Fields
that do not change what is generated (store, metadata, user, service_tier, parallel_tool_calls) are
accepted and have no effect.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
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
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse

from workers.protocol import ChoiceChunk, LogprobItem
from workers.serving.json_schema import JSON_OBJECT, InvalidSchema, canonical_schema, grammar_of
from workers.serving.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

STOP_MAX_CHARS = 512  # the longest stop string accepted (characters); docs/api.md says so
MAX_N = 16  # choices per request at most
STRICT = ConfigDict(extra="forbid", strict=True)  # strict: no lax coercion ("1.5" -> 1.5, true -> 1)


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def out_of_range(body: object, path: tuple = ()) -> str | None:
    """The path in a request body of its first integer outside what crosses to a replica (int64 to
    uint64: msgspec's), for the 400 that names it; None where there is none."""
    if isinstance(body, int) and not isinstance(body, bool):
        return ".".join(map(str, path)) if not -(2**63) <= body < 2**64 else None
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    for key, value in items:
        found = out_of_range(value, (*path, key))
        if found is not None:
            return found
    return None


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error JSON (also the last event of a stream that failed)."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        408: "invalid_request_error",
        413: "invalid_request_error",
        503: "service_unavailable",
    }.get(status, "server_error")
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
    include_obfuscation: StrictBool | None = None  # OpenAI pads chunks when true; none are padded here


TOP_K_NO_LIMIT = 2**63 - 1  # a top_k of the vocabulary's size or more keeps every token: this one too


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    """OpenAI's json_schema: `strict` is accepted and the schema is always enforced."""

    model_config = STRICT
    name: StrictStr = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: StrictStr | None = None
    schema_: dict[StrictStr, Any] = Field(default_factory=dict, alias="schema")  # absent: any JSON value
    strict: StrictBool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


# Fields OpenAI's reference marks nullable whose null means the default (clients and wrapper libraries
# pass their own unset defaults through as null)
NULL_MEANS_DEFAULT = (
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "echo",
)


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if not (v is None and k in NULL_MEANS_DEFAULT and k in fields)}
        return data

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise PydanticCustomError("stream_options", "stream_options is only allowed with stream: true")
        return v

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # strict floats take ints too
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(0, ge=0)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # vLLM-compatible extension (benchmarks): generate max_tokens regardless
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0, allow_inf_nan=False)  # vLLM's extension (HF semantics)
    logit_bias: dict[StrictStr, StrictFloat] | None = None
    response_format: ResponseFormat | None = None  # for completions too, as vLLM
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

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        """Token ids as decimal strings, biases in [-100, 100]; ids beyond the vocabulary are the
        replica's 400 (only it knows the vocabulary)."""
        if len(v or {}) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in (v or {}).items():
            if not token.isascii() or not token.isdigit() or len(token) > 9:
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {token[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        return v

    @field_validator("response_format")
    @classmethod
    def _compilable(cls, v: TextFormat | JsonObjectFormat | JsonSchemaFormat | None) -> Any:
        """A schema the grammar engine cannot compile is refused here, before any replica sees it."""
        if isinstance(v, JsonSchemaFormat):
            try:
                grammar_of(canonical_schema(v.json_schema.schema_))
            except InvalidSchema as e:
                raise PydanticCustomError("invalid_schema", str(e)) from e
        return v

    def json_schema(self) -> str | None:
        """The canonical schema the completion must satisfy (response_format), or None."""
        if isinstance(self.response_format, JsonSchemaFormat):
            return canonical_schema(self.response_format.json_schema.schema_)
        return JSON_OBJECT if isinstance(self.response_format, JsonObjectFormat) else None

    def requested_max_tokens(self) -> int | None:
        """max_tokens as asked; None = the endpoint's default, which the replica fits to the room
        the prompt leaves."""
        return self.max_tokens

    def max_tokens_field(self) -> str:
        """The field the client set the completion's length with: what a 400 about it names."""
        return "max_tokens"

    def logprob_count(self) -> int | None:
        """How many alternatives each token's logprob lists (None: no logprobs)."""
        return None

    def sampling(self) -> SamplingParams:
        """How the engine samples; its max_tokens is the replica's to set (`requested_max_tokens`)."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=min(self.top_k, TOP_K_NO_LIMIT),
            seed=self.seed,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            logprobs=self.logprob_count(),
            json_schema=self.json_schema(),
        )


def _no_suffix(value: Any) -> None:
    if value is None:
        return None
    raise PydanticCustomError("unsupported", "suffix is not supported")


def _one_of_best(value: Any) -> int | None:
    if value is None or (type(value) is int and value == 1):
        return value
    raise PydanticCustomError("unsupported", "best_of other than 1 is not supported; use n")


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictInt]
    echo: Annotated[Literal[False], _json_type("a boolean", bool)] = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Annotated[None, BeforeValidator(_no_suffix)] = None  # null, as OpenAI's clients may send it
    best_of: Annotated[int | None, BeforeValidator(_one_of_best)] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        """OpenAI's batch forms (a list of strings, a list of token-id lists) with one prompt are that
        prompt; a batch of several is refused by name (one prompt per request here)."""
        if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
            if len(v) > 1:
                raise PydanticCustomError(
                    "batch",
                    "a batch of {count} prompts is not supported: send one prompt (a string or a list of "
                    "token ids) per request",
                    {"count": len(v)},
                )
            return v[0]
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int]) -> str | list[int]:
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    def logprob_count(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: StrictStr


def _no_tool_calls(value: Any) -> None:
    """Tool calls in a message (null or [] ask for none): what a client sends back of a reply it got."""
    if value is None or value == []:
        return None
    raise PydanticCustomError("tools", "tool calling is not supported")


NoToolCalls = Annotated[None, BeforeValidator(_no_tool_calls)]


class ChatMessage(BaseModel):
    """A message. An assistant message may be a reply as the openai client dumps it (refusal,
    tool_calls, function_call, audio and annotations null, content null)."""

    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    # validated when left out too: only an assistant message may go without content
    content: StrictStr | list[TextPart] | None = Field(None, validate_default=True)
    name: StrictStr | None = None
    refusal: StrictStr | None = None
    tool_calls: NoToolCalls = None
    function_call: NoToolCalls = None
    audio: None = None
    annotations: list[dict[StrictStr, Any]] | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _no_tool_results(cls, v: Any) -> Any:
        if v in ("tool", "function"):
            raise PydanticCustomError("tools", "tool calling is not supported (a '{role}' message)", {"role": v})
        return v

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, v: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if v is None and role != "assistant":
            raise PydanticCustomError("content", "content is required in a {role} message", {"role": role})
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this model reads text only")
        return v

    def for_template(self) -> dict[str, str]:
        """The message as a chat template reads it: text parts joined (the replica hands a template
        that reads parts one part, `template_messages`), `developer` (OpenAI's newer name for system
        instructions) as `system`."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return {**out, "name": self.name} if self.name is not None else out


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    parallel_tool_calls: StrictBool | None = None  # meaningless without tools, which are refused
    tools: None = None
    tool_choice: None = None
    functions: None = None  # the legacy names of tools and tool_choice
    function_call: None = None

    @field_validator("tools", "tool_choice", "functions", "function_call", mode="before")
    @classmethod
    def _no_tools(cls, v: Any) -> None:
        """Tools are refused; `tools: []` and `tool_choice: "none"` (and their legacy names) ask
        for none, and are served."""
        if v is None or (isinstance(v, list) and not v) or v == "none":
            return None
        raise ValueError("tool calling is not supported")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens served from the prefix cache, not computed."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _cached_of(by_choice: dict[int, int]) -> int:
    """A request's cached prompt tokens from its choices' (each prefilled the prompt): the fewest."""
    return min(by_choice.values(), default=0)


@dataclass
class Choice:
    """One choice of a whole response, collected from the replica's items for it. cached_tokens:
    its first item's (a stream continued elsewhere prefills again; its prompt was cached or not once)."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    logprobs: list[LogprobItem] = field(default_factory=list)
    cached_tokens: int | None = None

    def add(self, chunk: ChoiceChunk) -> None:
        if self.cached_tokens is None:
            self.cached_tokens = chunk.cached_tokens
        self.text += chunk.text
        self.finish_reason = chunk.finish_reason
        self.completion_tokens = chunk.completion_tokens
        self.logprobs.extend(chunk.logprobs or ())


def _text(token: bytes) -> str:
    """A token's text: its bytes as UTF-8, a piece of a split character as U+FFFD."""
    return token.decode("utf-8", "replace")


def _by_token(item: LogprobItem) -> dict[str, float]:
    """Legacy top_logprobs, token -> logprob: the alternatives and, as OpenAI's always does (so up
    to logprobs + 1 entries, and one with `logprobs: 0`), the sampled token; of tokens that read the
    same (pieces of different characters each read as U+FFFD), the more likely one's. The
    alternatives come most likely first (a top-k), and a sampled token outside them is no more
    likely than the last, so it goes last."""
    out: dict[str, float] = {}
    for token, logprob in [*item.top, (item.token, item.logprob)]:
        out.setdefault(_text(token), logprob)
    return out


class ResponseShape:
    """Builds the JSON of one completion or chat completion, whole or as stream chunks. Logprobs
    come from the replica as a `LogprobItem` per token."""

    def __init__(self, chat: bool, model: str, n: int = 1, logprobs: bool = False) -> None:
        self.chat = chat
        self.model = model
        self.n = n
        self.logprobs = logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._text_offset = [0] * n  # completions: where each choice's next token starts in its text

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, choices: list[Choice], prompt_tokens: int) -> dict:
        out = []
        for index, c in enumerate(choices):
            choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choice["logprobs"] = self._logprobs(index, c.logprobs)
            out.append(choice)
        completion_tokens = sum(c.completion_tokens for c in choices)
        cached = _cached_of({i: c.cached_tokens or 0 for i, c in enumerate(choices)})
        return {**self._base(self.object), "choices": out, "usage": usage(prompt_tokens, completion_tokens, cached)}

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool = False,
        index: int = 0,
        logprobs: list[LogprobItem] | None = None,
    ) -> dict:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(index, logprobs or [])
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_by_choice: dict[int, int] | None = None
    ) -> dict:
        """The stream's last chunk; cached_by_choice: each choice's cached prompt tokens (its first item's)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        cached = _cached_of(cached_by_choice or {})
        return {**self._base(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)}

    def _logprobs(self, index: int, tokens: list[LogprobItem]) -> dict | None:
        """OpenAI's logprobs of these tokens of choice `index`: chat's content list, or the legacy
        completions shape (its text_offset counting on from the choice's earlier chunks)."""
        if not self.logprobs:
            return None
        if self.chat:
            content = [
                {
                    "token": _text(t.token),
                    "logprob": t.logprob,
                    "bytes": list(t.token),
                    "top_logprobs": [{"token": _text(a), "logprob": lp, "bytes": list(a)} for a, lp in t.top],
                }
                for t in tokens
            ]
            return {"content": content, "refusal": None}
        offsets, texts = [], [_text(t.token) for t in tokens]
        for text in texts:
            offsets.append(self._text_offset[index])
            self._text_offset[index] += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [_by_token(t) for t in tokens],
            "text_offset": offsets,
        }
