"""Request parsing before anything reaches a replica: the body is strict JSON (no lone surrogates, no
NaN or Infinity) and every field takes only its own JSON type, so bad input is a 400 naming what is
wrong, never a 500 further on."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

import app.ingress
from app.ingress import BodyError, _admin_json, _json_body, _validation_message, api, validated
from app.openai_protocol import STOP_MAX_CHARS, ChatRequest, Choice, CompletionRequest, ResponseShape, out_of_range
from workers.protocol import ChoiceChunk, LogprobItem
from workers.serving.detokenizer import DetokState


def request_of(chunks: list[bytes], headers: dict[str, str] | None = None, end: str = "body") -> Request:
    """A real Starlette request whose body arrives in `chunks`, then ends (`end`: "body"), or the
    client goes away ("disconnect"), or nothing more comes ("stall")."""
    messages = [
        {"type": "http.request", "body": c, "more_body": end != "body" or i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        if end == "disconnect":
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # a client that stopped sending

    raw_headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw_headers}, receive)


def body_of(request: Request) -> dict | BodyError:
    try:
        return asyncio.run(_json_body(request))
    except BodyError as e:
        return e


def parse(raw: bytes) -> dict | BodyError:
    return body_of(request_of([raw]))


def error_message(raw: bytes) -> str:
    error = parse(raw)
    assert isinstance(error, BodyError) and error.status == 400
    return str(error)


# -- the body --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [rb'{"prompt": "\ud800"}', rb'{"prompt": "a\udfffb"}', rb'{"prompt": "\ud800\ud800"}', rb'{"x": "\ud800\n"}'],
    ids=["high", "low", "two-highs", "high-then-other-escape"],
)
def test_lone_surrogate_escape_is_400(raw):
    """json.loads accepts a lone UTF-16 surrogate (which no tokenizer can encode); the strict parser
    refuses it and the message says what it is."""
    assert json.loads(raw)  # the lax parser would have let it through
    message = error_message(raw)
    assert "not valid JSON" in message and "surrogate" in message


def test_surrogate_pair_is_one_character():
    """A proper pair of escapes is the character it encodes."""
    assert parse(rb'{"prompt": "\ud83d\ude00"}') == {"prompt": "\N{GRINNING FACE}"}


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_400(literal):
    """JavaScript's non-finite literals are not JSON: a 400 naming them."""
    raw = b'{"model": "m", "temperature": ' + literal + b"}"
    assert json.loads(raw)
    message = error_message(raw)
    assert "not valid JSON" in message and "NaN and Infinity" in message


@pytest.mark.parametrize(
    "raw",
    [b'{"n": ' + b"9" * 5000 + b"}", b'{"p": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"{not json", b"\xff"],
    ids=["int-beyond-4300-digits", "nested-too-deep", "malformed", "not-utf8"],
)
def test_unparseable_bodies_are_400(raw):
    """Bodies json.loads chokes on with exceptions other than JSONDecodeError (ValueError for the
    huge integer) or that the strict parser refuses are a 400 too; one nested past the parser's
    limit says so (it read "not valid JSON: recursion limit exceeded")."""
    expected = "nested too deeply" if b"[" * 1000 in raw else "not valid JSON"
    assert expected in error_message(raw)


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"null", b"3"])
def test_non_object_body_is_400(raw):
    assert error_message(raw) == "request body must be a JSON object"


def test_object_body_is_returned():
    assert parse(b'{"model": "m", "prompt": "hi", "temperature": 0.5}') == {
        "model": "m",
        "prompt": "hi",
        "temperature": 0.5,
    }


# -- the fields ------------------------------------------------------------------------------------

COMPLETION = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

# (case id, schema, body changes, the field the error must name)
LAX = [
    ("temperature-string", CompletionRequest, {"temperature": "1.5"}, "temperature"),
    ("temperature-bool", CompletionRequest, {"temperature": True}, "temperature"),
    ("top_p-string", CompletionRequest, {"top_p": "0.5"}, "top_p"),
    ("top_p-bool", CompletionRequest, {"top_p": True}, "top_p"),
    ("max_tokens-bool", CompletionRequest, {"max_tokens": True}, "max_tokens"),
    ("max_tokens-float", CompletionRequest, {"max_tokens": 4.0}, "max_tokens"),
    ("max_tokens-string", CompletionRequest, {"max_tokens": "4"}, "max_tokens"),
    ("top_k-bool", CompletionRequest, {"top_k": True}, "top_k"),
    ("seed-bool", CompletionRequest, {"seed": False}, "seed"),
    ("seed-string", CompletionRequest, {"seed": "7"}, "seed"),
    ("stop-number", CompletionRequest, {"stop": 5}, "stop"),
    ("stop-list-of-numbers", CompletionRequest, {"stop": ["a", 5]}, "stop"),
    ("stop-over-cap", CompletionRequest, {"stop": "x" * (STOP_MAX_CHARS + 1)}, "stop"),
    ("stop-list-over-cap", CompletionRequest, {"stop": ["a", "x" * (STOP_MAX_CHARS + 1)]}, "stop"),
    ("user-number", CompletionRequest, {"user": 5}, "user"),
    ("model-number", CompletionRequest, {"model": 5}, "model"),
    ("prompt-bool-ids", CompletionRequest, {"prompt": [True, 2]}, "prompt"),
    ("n-bool", CompletionRequest, {"n": True}, "n"),
    ("n-float", CompletionRequest, {"n": 1.0}, "n"),
    ("presence_penalty-bool", CompletionRequest, {"presence_penalty": False}, "presence_penalty"),
    ("frequency_penalty-bool", CompletionRequest, {"frequency_penalty": False}, "frequency_penalty"),
    ("echo-zero", CompletionRequest, {"echo": 0}, "echo"),
    ("stream-int", CompletionRequest, {"stream": 1}, "stream"),
    (
        "include_usage-int",
        CompletionRequest,
        {"stream": True, "stream_options": {"include_usage": 1}},
        "stream_options",
    ),
    ("temperature-infinite", CompletionRequest, {"temperature": float("inf")}, "temperature"),
    ("content-number", ChatRequest, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("content-null", ChatRequest, {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ("name-number", ChatRequest, {"messages": [{"role": "user", "content": "hi", "name": 1}]}, "messages.0.name"),
    ("logprobs-zero", ChatRequest, {"logprobs": 0}, "logprobs"),
    ("max_completion_tokens-bool", ChatRequest, {"max_completion_tokens": True}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("schema", "changes", "field"), [c[1:] for c in LAX], ids=[c[0] for c in LAX])
def test_lax_values_are_refused(schema, changes, field):
    """No coercion: a string is not a number, a bool is not an integer, a number is not a string."""
    base = COMPLETION if schema is CompletionRequest else CHAT
    with pytest.raises(ValidationError) as info:
        schema.model_validate({**base, **changes})
    locs = [".".join(str(p) for p in e["loc"]) for e in info.value.errors()]
    assert any(loc == field or loc.startswith(field + ".") for loc in locs), locs


def test_ints_are_numbers():
    """JSON has one number type: an integer temperature or top_p is accepted (as a float)."""
    req = CompletionRequest.model_validate({**COMPLETION, "temperature": 1, "top_p": 1, "presence_penalty": 0})
    sampling = req.sampling()
    assert sampling.temperature == 1.0 and isinstance(sampling.temperature, float)
    assert sampling.top_p == 1.0 and isinstance(sampling.top_p, float)


def test_valid_values_pass():
    """The strict schema still takes every valid field."""
    req = ChatRequest.model_validate(
        {
            **CHAT,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 3,
            "seed": -1,
            "stop": ["a", "b"],
            "n": 1,
            "user": "u",
            "logprobs": False,
            "max_completion_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert req.requested_max_tokens() == 5 and req.sampling().stop == ("a", "b")
    assert CompletionRequest.model_validate({**COMPLETION, "prompt": [1, 2], "echo": False}).prompt == [1, 2]


def test_stop_at_the_cap_is_accepted():
    """The cap is inclusive: STOP_MAX_CHARS characters (not bytes) is fine, one more is not."""
    stop = "€" * STOP_MAX_CHARS
    assert CompletionRequest.model_validate({**COMPLETION, "stop": stop}).sampling().stop == (stop,)
    with pytest.raises(ValidationError, match=str(STOP_MAX_CHARS)):
        CompletionRequest.model_validate({**COMPLETION, "stop": stop + "€"})


def test_what_common_clients_send_is_served():
    """Content as a list of text parts, the developer role, and fields that change nothing that is
    generated (store, metadata, service_tier, parallel_tool_calls, a text response_format)."""
    req = ChatRequest.model_validate(
        {
            **CHAT,
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Say hi."}],
                },
                {"role": "user", "content": "hi", "name": "ann"},
            ],
            "store": False,
            "metadata": {"trace": "x"},
            "service_tier": "auto",
            "parallel_tool_calls": True,
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "tools": [],
        }
    )
    assert req.tools is None and req.tool_choice is None  # asking for no tool is served
    system = {"role": "system", "content": "Be brief. Say hi."}
    user = {"role": "user", "content": "hi", "name": "ann"}
    assert [m.for_template() for m in req.messages] == [system, user]


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
            "'image_url' are not supported",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content", "text"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling is not supported"),
        ({"tool_choice": "auto"}, "tool_choice", "tool calling is not supported"),
        ({"response_format": {"type": "regex"}}, "response_format", "'text', 'json_object', 'json_schema'"),
        ({"metadata": {"k": 1}}, "metadata", "string"),
        ({"functions": [{"name": "f"}]}, "functions", "tool calling is not supported"),
        ({"function_call": "auto"}, "function_call", "tool calling is not supported"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4", "tool_call_id": "c"}]},
            "messages.1.role",
            "tool calling is not supported",
        ),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]},
            "messages.0.tool_calls",
            "tool calling is not supported",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "content is required in a user"),
        ({"messages": [{"role": "user"}]}, "messages.0.content", "content is required in a user"),
        (
            {"messages": [{"role": "developer"}, {"role": "user", "content": "hi"}]},
            "messages.0.content",
            "content is required in a developer",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream: true"),
    ],
)
def test_what_would_change_the_meaning_of_a_request_is_refused_naming_it(changes, field, says):
    body = {**CHAT, **changes}
    with pytest.raises(ValidationError) as info:
        ChatRequest.model_validate(body)
    error = info.value.errors()[0]
    assert ".".join(map(str, error["loc"])).startswith(field) and says in str(info.value)
    message, _ = _validation_message(info.value, body)
    assert "Value error" not in message  # the client reads our words, not pydantic's


# -- n, penalties, logit_bias, logprobs ------------------------------------------------------------


# -- response_format -----------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("schema", [ChatRequest, CompletionRequest])
def test_response_formats_reach_the_sampling_fields_as_one_canonical_schema(schema):
    """Both endpoints take it (completions as vLLM does); the schema crosses as compact JSON in its
    own key order, json_object as any object, text as nothing."""
    body = CHAT if schema is ChatRequest else COMPLETION
    spec = {"name": "Person", "schema": PERSON, "strict": True, "description": "who"}
    formats = {
        None: None,
        "text": None,
        "json_object": '{"type":"object"}',
        "json_schema": json.dumps(PERSON, separators=(",", ":")),
    }
    for kind, expected in formats.items():
        fmt = None if kind is None else {"type": kind, **({"json_schema": spec} if kind == "json_schema" else {})}
        req = schema.model_validate({**body, **({"response_format": fmt} if fmt else {})})
        assert req.sampling().json_schema == expected


@pytest.mark.parametrize(
    ("fmt", "param", "says"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "P", "schema": {"type": "strin"}}},
            "response_format",
            "strin",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "P", "schema": {"type": "string", "format": "bogus"}}},
            "response_format",
            "Unknown format: bogus",
        ),
        ({"type": "grammar"}, "response_format", "'text', 'json_object', 'json_schema'"),
        ({"type": "json_schema"}, "response_format.json_schema", "Field required"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema", "name"),
        ({"type": "json_schema", "json_schema": {"name": "P", "schema": [1]}}, "response_format.json_schema", "dict"),
        ({"type": "json_object", "schema": {}}, "response_format.schema", "Extra inputs"),
    ],
)
def test_a_response_format_that_cannot_be_served_is_a_400_naming_it(fmt, param, says):
    body = {**CHAT, "response_format": fmt}
    with pytest.raises(ValidationError) as info:
        ChatRequest.model_validate(body)
    message, field = _validation_message(info.value, body)
    assert field.startswith(param) and says in message, (message, field)


def test_penalties_bias_and_logprobs_reach_the_sampling_fields():
    """The fields the engine serves are passed on as SamplingParams takes them: logit_bias keys as
    token ids, chat's logprobs/top_logprobs as the number of alternatives (0 with logprobs alone)."""
    req = CompletionRequest.model_validate(
        {
            **COMPLETION,
            "n": 16,
            "presence_penalty": -2,
            "frequency_penalty": 1.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"50256": -100, "7": 2.5},
            "logprobs": 20,
        }
    )
    sampling = req.sampling()
    assert req.n == 16
    assert sampling.presence_penalty == -2.0 and sampling.frequency_penalty == 1.5
    assert sampling.repetition_penalty == 1.2 and sampling.logprobs == 20
    assert sampling.logit_bias == ((50256, -100.0), (7, 2.5))
    assert CompletionRequest.model_validate(COMPLETION).sampling().logprobs is None
    assert CompletionRequest.model_validate({**COMPLETION, "logprobs": 0}).sampling().logprobs == 0
    chat = [
        ChatRequest.model_validate({**CHAT, **c}).sampling().logprobs
        for c in ({}, {"logprobs": False}, {"logprobs": True}, {"logprobs": True, "top_logprobs": 5})
    ]
    assert chat == [None, None, 0, 5]


BAD_SAMPLING = [
    ("n-zero", CompletionRequest, {"n": 0}, "n"),
    ("n-17", ChatRequest, {"n": 17}, "n"),
    ("presence-too-high", CompletionRequest, {"presence_penalty": 2.5}, "presence_penalty"),
    ("frequency-too-low", ChatRequest, {"frequency_penalty": -3}, "frequency_penalty"),
    ("repetition-zero", CompletionRequest, {"repetition_penalty": 0}, "repetition_penalty"),
    ("repetition-string", CompletionRequest, {"repetition_penalty": "1.1"}, "repetition_penalty"),
    ("logit_bias-list", CompletionRequest, {"logit_bias": [1, 2]}, "logit_bias"),
    ("logit_bias-word-key", CompletionRequest, {"logit_bias": {"hello": 1}}, "logit_bias"),
    ("logit_bias-negative-key", CompletionRequest, {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("logit_bias-huge-key", CompletionRequest, {"logit_bias": {"9" * 40: 1}}, "logit_bias"),
    ("logit_bias-too-high", ChatRequest, {"logit_bias": {"5": 101}}, "logit_bias"),
    ("logit_bias-bool", ChatRequest, {"logit_bias": {"5": True}}, "logit_bias"),
    ("logit_bias-too-many", ChatRequest, {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("completion-logprobs-21", CompletionRequest, {"logprobs": 21}, "logprobs"),
    ("completion-logprobs-bool", CompletionRequest, {"logprobs": True}, "logprobs"),
    ("chat-top_logprobs-21", ChatRequest, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat-top_logprobs-without-logprobs", ChatRequest, {"top_logprobs": 2}, "top_logprobs"),
    ("chat-top_logprobs-with-logprobs-false", ChatRequest, {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize(
    ("schema", "changes", "field"), [c[1:] for c in BAD_SAMPLING], ids=[c[0] for c in BAD_SAMPLING]
)
def test_bad_sampling_fields_are_refused_naming_them(schema, changes, field):
    base = COMPLETION if schema is CompletionRequest else CHAT
    with pytest.raises(ValidationError) as info:
        schema.model_validate({**base, **changes})
    assert field in str(info.value)


# -- response shapes -------------------------------------------------------------------------------


def chunk(
    text: str, finish_reason: str | None, completion_tokens: int, logprobs: list[LogprobItem], cached_tokens: int = 0
) -> ChoiceChunk:
    detok = DetokState(0, 0, "")
    return ChoiceChunk(0, text, finish_reason, 3, cached_tokens, completion_tokens, [], None, detok, "r", logprobs)


TOKENS = [
    LogprobItem(b"Hi", -0.5, [(b"Hi", -0.5), (b"Ho", -1.25)]),
    LogprobItem("é".encode(), -2.0, [(b"a", -0.1), ("é".encode(), -2.0), (b"a", -2.5)]),
]
SPLIT = [LogprobItem(b"\xf0\x9f", -0.1, [(b"\xf0\x9f", -0.1), (b"\xf0\x9e", -3.0)]), LogprobItem(b"\x91\x8d", -0.2, [])]


def test_whole_chat_response_with_choices_and_logprobs():
    """n choices in index order, usage counting the prompt once and every choice's tokens; chat's
    logprobs as OpenAI shapes them, with each token's UTF-8 bytes."""
    shape = ResponseShape(True, "m", n=2, logprobs=True)
    first, second = Choice(), Choice()
    first.add(chunk("Hié", "length", 2, TOKENS))
    second.add(chunk("x", None, 1, TOKENS[:1]))
    second.add(chunk("", "stop", 1, []))
    body = shape.whole([first, second], prompt_tokens=7)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["Hié", "x"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    content = body["choices"][0]["logprobs"]["content"]
    e_acute = {"token": "é", "logprob": -2.0, "bytes": [0xC3, 0xA9]}
    a = {"token": "a", "logprob": -0.1, "bytes": [97]}
    assert content[1] == {**e_acute, "top_logprobs": [a, e_acute, {**a, "logprob": -2.5}]}
    assert len(body["choices"][1]["logprobs"]["content"]) == 1
    plain = ResponseShape(True, "m").whole([first], prompt_tokens=7)
    assert plain["choices"][0]["logprobs"] is None


def test_a_character_split_across_tokens_is_joined_from_their_bytes():
    """Each piece of a split character reads as U+FFFD, and its bytes are the piece's own (not
    U+FFFD's), so a client joins them into the character, as OpenAI's `bytes` field is for."""
    content = ResponseShape(True, "m", logprobs=True).chunk("👍", None, logprobs=SPLIT)["choices"][0]["logprobs"]
    tokens = content["content"]
    assert all(set(t["token"]) == {"\ufffd"} for t in tokens)
    assert bytes(tokens[0]["bytes"] + tokens[1]["bytes"]).decode() == "👍"
    assert tokens[0]["top_logprobs"][1]["bytes"] == [0xF0, 0x9E]
    legacy = ResponseShape(False, "m", logprobs=True).chunk("👍", None, logprobs=SPLIT)["choices"][0]["logprobs"]
    assert legacy["top_logprobs"][0] == {"\ufffd": -0.1}  # two pieces that read alike: the more likely one


def test_completion_top_logprobs_always_hold_the_sampled_token():
    """OpenAI's legacy top_logprobs always hold the sampled token (up to logprobs + 1 entries):
    `logprobs: 0` gave `{}` for every token, and a sampled token outside the top k was missing, so
    a client reading `top_logprobs[i][tokens[i]]` failed."""
    drawn = [LogprobItem(b" a", -1.25, []), LogprobItem(b" high", -7.5, [(b" place", -0.5), (b" vast", -1.0)])]
    legacy = ResponseShape(False, "m", logprobs=True).chunk(" a high", None, logprobs=drawn)["choices"][0]["logprobs"]
    assert legacy["top_logprobs"] == [{" a": -1.25}, {" place": -0.5, " vast": -1.0, " high": -7.5}]
    assert all(
        top[token] == lp for token, lp, top in zip(*(legacy[k] for k in ("tokens", "token_logprobs", "top_logprobs")))
    )


def test_completion_logprobs_are_the_legacy_shape_with_offsets_across_chunks():
    """tokens, token_logprobs, top_logprobs (token -> logprob; of two tokens that read the same,
    the more likely) and text_offset, which goes on counting from one chunk of a choice to its
    next, apart for each choice."""
    shape = ResponseShape(False, "m", n=2, logprobs=True)
    one = shape.chunk("Hié", None, index=0, logprobs=TOKENS)["choices"][0]
    assert one["index"] == 0 and one["text"] == "Hié"
    assert one["logprobs"] == {
        "tokens": ["Hi", "é"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"Hi": -0.5, "Ho": -1.25}, {"a": -0.1, "é": -2.0}],
        "text_offset": [0, 2],
    }
    assert shape.chunk("Hi", None, index=0, logprobs=TOKENS[:1])["choices"][0]["logprobs"]["text_offset"] == [3]
    other = shape.chunk("Hi", "stop", index=1, logprobs=TOKENS[:1])["choices"][0]
    assert other["index"] == 1 and other["logprobs"]["text_offset"] == [0] and other["finish_reason"] == "stop"
    assert ResponseShape(False, "m").chunk("x", None)["choices"][0]["logprobs"] is None


def test_chat_chunks_open_each_choice_with_the_role():
    shape = ResponseShape(True, "m", n=2)
    assert shape.chunk("a", None, True, 1)["choices"][0] == {
        "index": 1,
        "finish_reason": None,
        "logprobs": None,
        "delta": {"role": "assistant", "content": "a"},
    }
    assert shape.chunk("b", None, False, 1)["choices"][0]["delta"] == {"content": "b"}


def test_openapi_declares_the_request_bodies():
    """The OpenAI handlers read their bodies themselves, yet /openapi.json describes them: each
    route's requestBody refers to its model, and the models (with the new fields) are there."""
    schema = api.openapi()
    components = schema["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert {"n", "logit_bias", "presence_penalty", "repetition_penalty", "logprobs"} <= set(
            components[model]["properties"]
        )
    assert "top_logprobs" in components["ChatRequest"]["properties"]
    assert components["ChatMessage"]["properties"]["role"]["enum"][0] == "system"
    refs = {v for v in json.dumps(schema).split('"') if v.startswith("#/")}
    assert all(ref.split("/")[-1] in components for ref in refs)  # every reference resolves


def test_usage_reports_the_fewest_cached_prompt_tokens_of_the_first_items():
    """cached_tokens per choice is its first item's (a continuation elsewhere prefills again); a
    request's is the fewest of its choices' (each prefilled the prompt)."""
    shape = ResponseShape(False, "m", n=2)
    first, second = Choice(), Choice()
    first.add(chunk("a", None, 1, [], cached_tokens=32))
    first.add(chunk("b", "length", 2, [], cached_tokens=0))
    second.add(chunk("c", "length", 1, [], cached_tokens=48))
    usage = shape.whole([first, second], prompt_tokens=50)["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32} and usage["total_tokens"] == 53
    usage_chunk = shape.usage_chunk(50, 3, {0: 48, 1: 16})
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert shape.usage_chunk(50, 3)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize(
    ("schema", "body", "param"),
    [
        (CompletionRequest, {"model": "m", "prompt": ["a", 3]}, "prompt"),  # not "prompt.str"
        (CompletionRequest, {"model": "m"}, "prompt"),
        (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        (ChatRequest, {"model": "m", "messages": [{"content": "x"}]}, "messages.0.role"),
        (
            ChatRequest,
            {
                "model": "m",
                "messages": [],
                "response_format": {"type": "json_schema", "json_schema": {"name": "P", "schema": 3}},
            },
            "response_format.json_schema.schema",  # not "response_format.json_schema.json_schema.schema"
        ),
    ],
)
def test_a_refused_field_is_named_by_its_path_in_the_body(schema, body, param):
    """The validator's own steps (the union member it tried, a tagged union's tag) are no part of
    the `param` a client gets: only the keys and indexes of what it sent, and a field it left out."""
    with pytest.raises(ValidationError) as info:
        schema.model_validate(body)
    assert _validation_message(info.value, body)[1] == param


def test_null_sampling_fields_mean_their_defaults():
    """OpenAI's nullable fields sent as null (what wrapper libraries pass through) are the defaults."""
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty"))
    assert ChatRequest.model_validate({**CHAT, **nulls}).sampling() == ChatRequest.model_validate(CHAT).sampling()
    req = CompletionRequest.model_validate({**COMPLETION, **nulls, "echo": None})
    assert req.n == 1 and req.stream is False and req.echo is False and req.temperature == 1.0


def test_a_reply_sent_back_as_the_openai_client_dumps_it_is_served():
    """An assistant message with refusal, tool_calls, function_call, audio and annotations null (the
    SDK's model_dump of a reply), or with content null, is a turn of the conversation."""
    reply = {
        "role": "assistant",
        "content": "Hello!",
        "refusal": None,
        "tool_calls": None,
        "function_call": None,
        "audio": None,
        "annotations": [],
    }
    messages = [{"role": "user", "content": "hi"}, reply, {"role": "assistant", "content": None}]
    req = ChatRequest.model_validate({**CHAT, "messages": messages})
    assert [m.for_template() for m in req.messages][1:] == [
        {"role": "assistant", "content": "Hello!"},
        {"role": "assistant", "content": ""},
    ]


def test_a_batch_prompt_of_one_is_that_prompt_and_of_several_is_refused():
    assert CompletionRequest.model_validate({**COMPLETION, "prompt": ["Say hi."]}).prompt == "Say hi."
    assert CompletionRequest.model_validate({**COMPLETION, "prompt": [[5, 6, 7]]}).prompt == [5, 6, 7]
    for batch in (["a", "b"], [[1], [2]]):
        with pytest.raises(ValidationError, match="a batch of 2 prompts is not supported"):
            CompletionRequest.model_validate({**COMPLETION, "prompt": batch})


def test_the_length_field_a_400_names_is_the_one_the_client_set():
    assert (
        ChatRequest.model_validate({**CHAT, "max_completion_tokens": 9}).max_tokens_field() == "max_completion_tokens"
    )
    assert ChatRequest.model_validate({**CHAT, "max_tokens": 9}).max_tokens_field() == "max_tokens"
    assert CompletionRequest.model_validate({**COMPLETION, "max_tokens": 9}).max_tokens_field() == "max_tokens"


def test_suffix_and_best_of_as_clients_may_send_them():
    """Null (and best_of 1) mean what the defaults mean; a suffix or best_of > 1 is refused by name.
    Chat has no echo: null or not, it is a field chat does not take."""
    req = CompletionRequest.model_validate({**COMPLETION, "suffix": None, "best_of": 1})
    assert req.sampling() == CompletionRequest.model_validate(COMPLETION).sampling()
    for field, value, says in (("suffix", "!", "suffix is not supported"), ("best_of", 2, "best_of other than 1")):
        with pytest.raises(ValidationError, match=says):
            CompletionRequest.model_validate({**COMPLETION, field: value})
    for echo in (None, False):
        with pytest.raises(ValidationError, match="echo"):
            ChatRequest.model_validate({**CHAT, "echo": echo})


def test_stream_options_include_obfuscation_is_accepted_and_changes_nothing():
    """The openai SDK sends it when a user sets it; no chunk is padded here, either way."""
    for value in (True, False, None):
        req = ChatRequest.model_validate(
            {**CHAT, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": value}}
        )
        assert req.stream_options.include_usage and req.sampling() == ChatRequest.model_validate(CHAT).sampling()


def test_a_json_schema_is_checked_off_the_event_loop(monkeypatch):
    """Compiling a large schema's grammar takes seconds: the check runs in a thread while the event
    loop (every other stream of the ingress) goes on. The check here waits for the loop to run a
    coroutine; on the loop itself it would wait in vain and fail the request."""
    import app.openai_protocol

    loop_ran = threading.Event()

    def slow_grammar(schema: str) -> str:
        assert loop_ran.wait(10), "the event loop was held while the schema compiled"
        return "grammar"

    monkeypatch.setattr(app.openai_protocol, "grammar_of", slow_grammar)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "T", "schema": {"type": "object"}}},
    }

    async def main() -> ChatRequest:
        check = asyncio.create_task(validated(ChatRequest, body))
        await asyncio.sleep(0)  # the check starts
        loop_ran.set()  # only if the check left the loop free
        return await asyncio.wait_for(check, 20)

    assert asyncio.run(main()).json_schema() == '{"type":"object"}'


def refusal(request: Request) -> tuple[int, str]:
    error = body_of(request)
    assert isinstance(error, BodyError)
    return error.status, str(error)


def test_a_body_past_the_transport_limit_is_a_413_not_a_503_to_retry(monkeypatch):
    """A request crosses to its replica in one message: past Serve's limit (4 MiB under gRPC) it
    failed there and the client got a 503 to retry, three uploads over. Refused by its declared
    length before reading it, or once the chunks read pass the limit."""
    monkeypatch.setattr(app.ingress, "MAX_BODY_BYTES", 100)
    declared = request_of([b"{}"], {"content-length": "101"})
    assert refusal(declared) == (
        413,
        "the request body has 101 bytes, more than this server takes (100)",
    )
    chunked = request_of([b'{"prompt": "', b"x" * 60, b"x" * 60, b'"}'])
    assert refusal(chunked)[0] == 413
    assert asyncio.run(_json_body(request_of([b'{"a": "', b"x" * 80, b'"}']))) == {"a": "x" * 80}
    assert app.ingress.MAX_BODY_BYTES < 4 * 2**20  # the gRPC default, less room for what the request adds


def test_a_body_that_stops_arriving_is_a_408_and_a_client_gone_a_400(monkeypatch):
    """A connection that sends headers and stops held one of the ingress's ongoing requests for
    ever (1,152 of them stalled /readyz too); a client gone mid-body was a 500 with a traceback."""
    monkeypatch.setattr(app.ingress, "BODY_TIMEOUT_S", 0.2)
    stalled = request_of([b'{"prompt"'], end="stall")
    assert refusal(stalled) == (408, "the request body did not arrive within 0.2 s")
    gone = request_of([b'{"prompt"'], end="disconnect")
    assert refusal(gone)[0] == 400


def test_an_admin_body_keeps_its_413_and_408_and_says_what_was_expected(monkeypatch):
    """The admin routes answered every unreadable body with the same 400 ("must be a JSON object"),
    a 4 MiB body and a stalled one included, and never said what was wrong with the JSON."""
    monkeypatch.setattr(app.ingress, "MAX_BODY_BYTES", 100)
    monkeypatch.setattr(app.ingress, "BODY_TIMEOUT_S", 0.2)

    def answer(request: Request) -> tuple[int, str]:
        response = asyncio.run(_admin_json(request, "a rollout plan"))
        assert isinstance(response, JSONResponse)
        return response.status_code, json.loads(response.body)["detail"]

    assert answer(request_of([b"{}"], {"content-length": "101"}))[0] == 413
    assert answer(request_of([b'{"steps"'], end="stall")) == (408, "the request body did not arrive within 0.2 s")
    status, detail = answer(request_of([b'{"steps": [}']))
    assert status == 400 and detail.startswith("request body must be a JSON object: a rollout plan (")
    assert "not valid JSON" in detail
    assert asyncio.run(_admin_json(request_of([b'{"steps": []}']), "a rollout plan")) == {"steps": []}


def test_starlettes_errors_are_openais_with_their_headers():
    """A GET on a POST route is a 405 in OpenAI's shape with its Allow header (RFC 9110), and a
    path with a doubled slash is still an API path (a 404 in OpenAI's shape)."""
    from fastapi.testclient import TestClient

    with TestClient(api) as http:
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = http.post("http://testserver//v1/chat/nowhere")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert http.get("/nowhere").json() == {"detail": "Not Found"}


def test_the_first_integer_beyond_what_crosses_to_a_replica_is_named_by_its_path():
    assert out_of_range({"max_tokens": 2**70}) == "max_tokens"
    assert out_of_range({"prompt": [1, 2, -(2**63) - 1]}) == "prompt.2"
    assert out_of_range({"messages": [{"role": "user", "content": "x"}], "n": 2**64, "seed": 2**64 - 1}) == "n"
    assert out_of_range({"max_tokens": 2**64 - 1, "stream": True, "prompt": [[0, -(2**63)]]}) is None
