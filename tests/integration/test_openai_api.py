"""The OpenAI-compatible API end to end: real Ray Serve, the real `openai` client, raw HTTP for the
SSE framing; malformed and hostile requests; the Prometheus exposition at /metrics.

One Ray instance for the module, serving the embedded tiny model (max_model_len 256). The tiny model
is a byte-level Llama with random weights: its greedy output is gibberish, but deterministic.
"""

from __future__ import annotations

import json
import time
import uuid

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.helpers import (
    API_KEYS,
    assert_openai_error,
    httpx,
    json_events,
    openai_client,
    running_app,
    settled,
    sse_events,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)

ADMIN_TOKEN = "admin-" + uuid.uuid4().hex
PROMPT = "Hello"
MAX_MODEL_LEN = 256
BROWSER_ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = {"cors_allowed_origins": [BROWSER_ORIGIN]}
    with running_app(tmp_path_factory.mktemp("api"), name="api", admin_token=ADMIN_TOKEN, args=args) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


@pytest.fixture(scope="module")
def greedy(server, client):
    """The reference: a non-streaming greedy completion of PROMPT."""
    return client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0)


def byte_prompt_tokens(prompt: str) -> int:
    """The embedded tokenizer is byte-level and adds a BOS token."""
    return len(prompt.encode()) + 1


# -- the openai client ---------------------------------------------------------------------------------


def test_models_list(server, client):
    """models.list returns exactly the served model; a wrong key is refused."""
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert client.models.retrieve(server.model).model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("no-such-model")
    with openai.OpenAI(base_url=server.v1, api_key="not-a-key", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.models.retrieve(server.model)


def test_completion_non_streaming(server, client):
    """A plain completion: text, finish_reason and usage counts that agree with each other."""
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == server.model and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason in ("length", "stop")
    u = r.usage
    assert u.prompt_tokens == byte_prompt_tokens(PROMPT)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    if choice.finish_reason == "length":
        assert u.completion_tokens == 12
    else:
        assert 1 <= u.completion_tokens < 12


def test_completion_max_tokens_respected(server, client, greedy):
    """The reference greedy call ran to its max_tokens (the tiny model does not stop early here)."""
    assert greedy.choices[0].finish_reason == "length"
    assert greedy.usage.completion_tokens == 24


def test_completion_streaming_matches_non_streaming(server, client, greedy):
    """Streamed chunks concatenate to the non-streaming greedy text; the stream ends with a usage
    chunk (include_usage) whose counts match the non-streaming call."""
    stream = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)  # the iterator must end on its own
    with_choices = [c for c in chunks if c.choices]  # that they are several: the next test
    assert "".join(c.choices[0].text for c in with_choices) == greedy.choices[0].text
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == greedy.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == greedy.usage.prompt_tokens
    assert usage_chunk.usage.total_tokens == greedy.usage.total_tokens


def test_a_long_stream_arrives_in_several_chunks_over_time(server, client):
    """Streaming really streams: 200 tokens arrive as several text chunks spread over time, not as
    one chunk holding the whole completion nor as a buffered burst at the end. How many tokens each
    chunk gathers depends on how busy the machine is, so only count and spread are asserted."""
    arrivals = []
    stream = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append((time.monotonic(), chunk.choices[0].text))
    assert len(arrivals) >= 3, [len(t) for _, t in arrivals]
    assert arrivals[-1][0] - arrivals[0][0] > 0.02  # at least one coalescing interval apart


def test_streaming_without_usage_has_no_usage_chunk(server, client):
    """Without stream_options every chunk carries a choice and none carries usage."""
    chunks = list(
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True)
    )
    assert chunks and all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_completion(server, client):
    """Chat, non-streaming and streaming: role assistant, same greedy content, consistent usage."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 10

    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == choice.message.content
    assert with_choices[-1].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_a_repeated_prefix_is_reported_as_cached_tokens(server, client):
    """The second request of a prompt reuses its full KV pages (16 tokens each, the page of its last
    token computed again): usage.prompt_tokens_details.cached_tokens says how many tokens, for
    completions and chat, whole and in a stream's usage chunk, with the same text as the first;
    /metrics counts the lookups and the cached pages."""
    prompt = f"{uuid.uuid4().hex} shared prefix of a conversation"  # 65 tokens: four full pages and 1
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=5, temperature=0)
    assert first.usage.prompt_tokens == byte_prompt_tokens(prompt) == 65
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=server.model, prompt=prompt, max_tokens=5, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 64 and again.choices[0].text == first.choices[0].text
    stream = client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64

    messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "and a question"}]
    chats = [client.chat.completions.create(model=server.model, messages=messages, max_tokens=5, temperature=0)]
    chats.append(client.chat.completions.create(model=server.model, messages=messages, max_tokens=5, temperature=0))
    cached = [c.usage.prompt_tokens_details.cached_tokens for c in chats]
    assert cached[0] == 0 and cached[1] == (chats[1].usage.prompt_tokens - 1) // 16 * 16
    assert chats[1].choices[0].message.content == chats[0].choices[0].message.content

    def total(families, name: str) -> float:
        return sum(s.value for s in families[name].samples if s.name.endswith("_total"))

    def counted():  # a replica's counters reach /metrics with its next status report
        families = _metrics(server)[1]
        return families if total(families, "graphserve_prefix_cache_hits_tokens") >= 64 * 2 + cached[1] else None

    families = wait_for(counted, 15, what="the prefix-cache hits to reach /metrics")
    assert total(families, "graphserve_prefix_cache_queries_tokens") > total(
        families, "graphserve_prefix_cache_hits_tokens"
    )
    (pages,) = families["graphserve_kv_pages_cached"].samples
    assert pages.value >= 4


def test_chat_max_completion_tokens(server, client):
    """max_completion_tokens (the newer chat name) caps the output like max_tokens."""
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3, temperature=0
    )
    assert r.usage.completion_tokens <= 3
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 3


def test_seed_reproducible(server, client):
    """With temperature > 0 the same seed gives the same text; other seeds give other texts."""

    def sample(seed: int) -> str:
        r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=seed)
        return r.choices[0].text

    first = sample(42)
    assert sample(42) == first
    streamed = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=42, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == first
    assert any(sample(seed) != first for seed in (43, 44, 45))


def _stop_point(text: str) -> tuple[int, str]:
    """A printable ASCII character of `text` (not its first) at its first occurrence."""
    for i, ch in enumerate(text):
        if i >= 1 and ch.isascii() and ch.isprintable() and ch not in text[:i]:
            return i, ch
    pytest.fail(f"no usable stop character in the greedy output {text!r}")


def test_stop_string(server, client, greedy):
    """A stop string cuts the text just before it, with finish_reason 'stop' (streaming too)."""
    text = greedy.choices[0].text
    i, stop = _stop_point(text)
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:i]
    assert stop not in r.choices[0].text
    assert r.usage.completion_tokens < 24

    stream = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == text[:i]
    assert with_choices[-1].choices[0].finish_reason == "stop"
    # tokens drawn past the stop string are not counted (the engine may run ahead of the reader)
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


# -- logprobs, n, penalties ------------------------------------------------------------------------------


def test_completion_logprobs(server, client, greedy):
    """logprobs=k: OpenAI's legacy shape, one entry per generated token; greedy, each token is its
    own most likely alternative; offsets count the token strings; streamed chunks carry the same."""
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3)
    (choice,) = r.choices
    assert choice.text == greedy.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 24
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 3
        assert top[token] == value == max(top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(24)]
    stream = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3, stream=True
    )
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for c in streamed for t in c.tokens] == lp.tokens
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset
    assert [v for c in streamed for v in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(server, client):
    """logprobs with top_logprobs: chat's content list, each token with its bytes and alternatives;
    without logprobs, none."""
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:  # a token's own bytes; its text is them read as UTF-8 (a split character's piece: U+FFFD)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = client.chat.completions.create(model=server.model, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content
    stream = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content] and all(e.top_logprobs == [] for e in entries)


def test_n_choices(server, client):
    """n=3 with a seed: three choices, the same on every call, choice 0 the n=1 answer; usage counts
    the prompt once and every choice's tokens. Streamed, chunks carry each choice's index and add up
    to the same texts; greedy n=2 gives two equal choices."""

    def ask(n: int):
        return client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=1.0,
            seed=7,
            n=n,
            extra_body={"ignore_eos": True},
        )

    r = ask(3)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [c.text for c in ask(3).choices] == texts
    assert ask(1).choices[0].text == texts[0]
    assert r.usage.prompt_tokens == byte_prompt_tokens(PROMPT) and r.usage.completion_tokens == 36
    assert r.usage.total_tokens == r.usage.prompt_tokens + 36
    stream = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    by_index = {
        i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)
    }
    assert list(by_index.values()) == texts
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 36 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    greedy = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_the_seed_header_samples_every_choice_of_an_unseeded_request_again(server, client):
    """An unseeded n=3 request answers with the seed it was sampled with; sent back as `seed`, it
    gives the same three choices, on both endpoints."""
    for create, body in (
        (client.completions.with_raw_response.create, {"prompt": PROMPT}),
        (client.chat.completions.with_raw_response.create, {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        ask = dict(model=server.model, max_tokens=12, temperature=1.3, n=3, extra_body={"ignore_eos": True}, **body)
        raw = create(**ask)
        first = raw.parse()
        again = create(**ask, seed=int(raw.headers["x-graphserve-seed"])).parse()
        texts = [c.text if hasattr(c, "text") else c.message.content for c in first.choices]
        assert len(set(texts)) == 3
        assert [c.text if hasattr(c, "text") else c.message.content for c in again.choices] == texts


def test_penalties_and_logit_bias(server, client, greedy):
    """logit_bias +100 forces its token; -100 on the greedy text's first token moves the first token
    off it; strong penalties (and vLLM's repetition_penalty) change the greedy text."""
    forced = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0.8,
        seed=1,
        logit_bias={"65": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == "AAAAA"
    first = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    token = first.choices[0].logprobs.tokens[0]
    token_id = ord(token) if len(token) == 1 and token.isascii() else None
    if token_id is not None:  # byte-level: an ASCII token string is its own id
        banned = client.completions.create(
            model=server.model, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(token_id): -100}
        )
        assert banned.choices[0].text != first.choices[0].text
    penalized = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        presence_penalty=2,
        frequency_penalty=2,
        extra_body={"repetition_penalty": 2.0},
    )
    assert penalized.choices[0].text != greedy.choices[0].text


def test_openapi_lists_the_request_models_and_bad_requests_stay_openai_400s(server):
    """/openapi.json has the completions and chat request bodies; a request that breaks them is
    still OpenAI's 400 JSON, never FastAPI's 422."""
    schema = server.http.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    assert {"CompletionRequest", "ChatRequest", "ChatMessage"} <= set(components)
    ref = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": "#/components/schemas/ChatRequest"}
    r = server.http.post(
        "/v1/chat/completions", json={**_body(server, "chat", {}), "n": "two"}, headers=server.key_headers()
    )
    assert assert_openai_error(r, 400, "n")["param"] == "n"


# -- raw HTTP: the SSE framing -------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_sse_stream_ends_with_done(server, chat):
    """The raw event stream: text/event-stream, one JSON object per `data:` line, then `data: [DONE]`;
    marked for proxies in front not to cache or buffer it (nginx holds a response by default)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {
        "model": server.model,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": PROMPT})
    with server.http.stream("POST", path, json=body, headers=server.key_headers()) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert (r.headers["cache-control"], r.headers["x-accel-buffering"]) == ("no-cache", "no")
        lines = [line for line in r.iter_lines() if line.strip()]
    payloads = sse_events(lines)
    assert len(payloads) == len(lines), lines  # nothing but data: lines
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    events = json_events(lines)
    assert events[-1]["usage"]["completion_tokens"] >= 1
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")


# -- bad inputs ----------------------------------------------------------------------------------------

COMPLETION = {"model": None, "prompt": PROMPT, "max_tokens": 4}
CHAT = {"model": None, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (case id, endpoint, body changes (None = remove the field), words the error message must contain)
BAD_BODIES = [
    ("max_tokens-string", "completions", {"max_tokens": "ten"}, ["max_tokens"]),
    ("max_tokens-zero", "completions", {"max_tokens": 0}, ["max_tokens"]),
    ("temperature-string", "completions", {"temperature": "hot"}, ["temperature"]),
    ("temperature-too-high", "completions", {"temperature": 5}, ["temperature"]),
    ("top_p-zero", "completions", {"top_p": 0}, ["top_p"]),
    ("prompt-int", "completions", {"prompt": 5}, ["prompt"]),
    ("prompt-missing", "completions", {"prompt": None}, ["prompt"]),
    ("prompt-empty-string", "completions", {"prompt": ""}, ["prompt"]),
    ("prompt-empty-list", "completions", {"prompt": []}, ["prompt"]),
    ("prompt-token-out-of-vocab", "completions", {"prompt": [1, 2, 10**6]}, ["prompt"]),
    ("unknown-field", "completions", {"frobnicate": True}, ["frobnicate"]),
    ("n-17", "completions", {"n": 17}, ["n"]),
    ("logprobs-21", "completions", {"logprobs": 21}, ["logprobs"]),
    ("logit_bias-out-of-vocab", "completions", {"logit_bias": {"999999": 5}}, ["logit_bias"]),
    ("logit_bias-word-key", "completions", {"logit_bias": {"hello": 5}}, ["logit_bias"]),
    ("presence_penalty-too-high", "completions", {"presence_penalty": 2.5}, ["presence_penalty"]),
    ("repetition_penalty-zero", "completions", {"repetition_penalty": 0}, ["repetition_penalty"]),
    ("stream-string", "completions", {"stream": "yes"}, ["stream"]),
    ("stop-too-many", "completions", {"stop": ["a", "b", "c", "d", "e"]}, ["stop"]),
    ("stop-empty", "completions", {"stop": [""]}, ["stop"]),
    ("seed-above-int64", "completions", {"seed": 2**63}, ["seed"]),
    ("seed-below-int64", "completions", {"seed": -(2**63) - 1}, ["seed"]),
    ("seed-float", "completions", {"seed": 1.5}, ["seed"]),
    ("model-missing", "completions", {"model": None}, ["model"]),
    ("prompt-too-long", "completions", {"prompt": "x" * (MAX_MODEL_LEN + 10)}, ["max_model_len"]),
    ("prompt-ids-too-long", "completions", {"prompt": [120] * (MAX_MODEL_LEN + 1)}, ["max_model_len"]),
    ("messages-empty", "chat", {"messages": []}, ["messages"]),
    ("messages-missing", "chat", {"messages": None}, ["messages"]),
    ("message-bad-role", "chat", {"messages": [{"role": "robot", "content": "hi"}]}, ["role"]),
    ("message-extra-field", "chat", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, ["x"]),
    ("chat-prompt-too-long", "chat", {"messages": [{"role": "user", "content": "y" * 300}]}, ["max_model_len"]),
    ("chat-n-0", "chat", {"n": 0}, ["n"]),
    ("chat-top_logprobs-without-logprobs", "chat", {"top_logprobs": 2}, ["top_logprobs"]),
    ("chat-logprobs-number", "chat", {"logprobs": 1}, ["logprobs"]),
]


def _body(server, endpoint: str, changes: dict) -> dict:
    body = dict(COMPLETION if endpoint == "completions" else CHAT, model=server.model)
    for key, value in changes.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


@pytest.mark.parametrize(
    ("endpoint", "changes", "needles"), [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES]
)
def test_bad_body_is_400(server, endpoint, changes, needles):
    """An invalid request body is a 400 in OpenAI's error shape naming what is wrong."""
    r = server.http.post(
        f"/v1/{'chat/' if endpoint == 'chat' else ''}completions",
        json=_body(server, endpoint, changes),
        headers=server.key_headers(),
    )
    error = assert_openai_error(r, 400, *needles)
    assert error["type"] == "invalid_request_error"


DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"just a string"', b"null", DEEP],
    ids=["malformed", "empty", "not-utf8", "array", "string", "null", "nested-too-deep"],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_object_json_is_400(server, raw, path):
    """Bodies that are not a JSON object are a 400 that says so."""
    headers = {**server.key_headers(), "Content-Type": "application/json"}
    error = assert_openai_error(server.http.post(path, content=raw, headers=headers), 400)
    assert "json" in error["message"].lower()


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer not-a-key", "Bearer", "Basic key-a", "key-a", f"Bearer {ADMIN_TOKEN}"],
    ids=["missing", "unknown", "empty", "basic-scheme", "no-scheme", "admin-token"],
)
def test_bad_api_key_is_401(server, authorization):
    """Requests without a known tenant key are a 401, before the body is even looked at."""
    headers = {"Authorization": authorization} if authorization else {}
    for path, body in (("/v1/completions", _body(server, "completions", {})), ("/v1/chat/completions", {})):
        error = assert_openai_error(server.http.post(path, json=body, headers=headers), 401, "API key")
        assert error["type"] == "authentication_error"
    assert_openai_error(server.http.get("/v1/models", headers=headers), 401)


def test_unknown_model_is_404(server, client):
    """Asking for a model that is not served is a 404 naming the served one."""
    r = server.http.post(
        "/v1/completions", json={**_body(server, "completions", {}), "model": "gpt-9"}, headers=server.key_headers()
    )
    assert_openai_error(r, 404, "gpt-9", server.model)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_openai_client_raises_bad_request(server, client):
    """The openai client surfaces our 400 as BadRequestError with our message."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, n=17)
    assert "n" in str(info.value)


def test_max_tokens_beyond_the_context_is_refused(server):
    """As OpenAI does: prompt + max_tokens beyond max_model_len is a 400 naming max_model_len; without
    max_tokens the default fits the room left, and the server keeps serving."""
    error = assert_openai_error(server.complete(max_tokens=10**9), 400, "max_tokens", str(MAX_MODEL_LEN))
    assert error["param"] == "max_tokens"
    r = server.complete(max_tokens=None)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 16
    assert server.complete(max_tokens=4).status_code == 200


def test_prompt_exactly_max_model_len(server):
    """A prompt that fills the whole context leaves no room for a completion: 400 naming
    max_model_len, whether or not max_tokens is given."""
    assert_openai_error(server.complete(prompt=[120] * MAX_MODEL_LEN, max_tokens=5), 400, str(MAX_MODEL_LEN))
    error = assert_openai_error(server.complete(prompt=[120] * MAX_MODEL_LEN, max_tokens=None), 400, "no room")
    assert error["param"] == "prompt"


def test_a_prompt_of_millions_of_characters_is_refused_at_once_and_stalls_no_stream(server, client):
    """4 MB of prompt cannot fit max_model_len whatever its tokens: a 400 naming `prompt` before any
    tokenizing, while a stream that was running goes on undisturbed."""
    stream = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks)
    error = assert_openai_error(server.complete(prompt="x" * 4_000_000, max_tokens=1), 400, str(MAX_MODEL_LEN))
    assert error["param"] == "prompt" and "characters" in error["message"]
    assert sum(1 for c in chunks if c.choices) >= 1  # the running stream finished


EXTREME = [
    ("top_k-beyond-int64", {"top_k": 2**70, "temperature": 1.0}),
    ("top_k-int64-max", {"top_k": 2**63 - 1, "temperature": 1.0}),
    ("max_tokens-beyond-int64", {"max_tokens": 2**70}),
    ("temperature-tiny", {"temperature": 1e-300}),
    ("top_p-tiny", {"top_p": 1e-300, "temperature": 1.0}),
    ("seed-int64-min", {"seed": -(2**63), "temperature": 1.0}),
    ("seed-int64-max", {"seed": 2**63 - 1, "temperature": 1.0}),
    ("stop-longer-than-output", {"stop": ["x" * 5000]}),
]


@pytest.mark.parametrize("fields", [c[1] for c in EXTREME], ids=[c[0] for c in EXTREME])
def test_extreme_values_do_not_take_the_engine_down(server, fields):
    """Valid but extreme sampling values are served (or refused with a 4xx); the engine loop, which
    batches every request together, survives them and the next request is served."""
    r = server.complete(**{"max_tokens": 4, **fields})
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
    if r.status_code == 200:
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    else:
        assert assert_openai_error(r, r.status_code)["param"] == next(iter(fields))  # the field, by its path
    if any(isinstance(v, float) and 0 < v < 1e-5 for v in fields.values()):  # fp32 cannot hold it: greedy (was token 0)
        greedy = server.complete(max_tokens=4, temperature=0)
        assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    after = server.complete(max_tokens=2)
    assert after.status_code == 200, after.text


def test_still_serves_after_bad_inputs(server, client):
    """After every malformed request above, a normal request still works."""
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    assert server.http.get("/healthz").json() == {"status": "ok"}


# -- /metrics ------------------------------------------------------------------------------------------

STEP_LABELS = {"execution_mode", "bucket_id", "fallback_reason", "model_revision", "attention_backend", "replica"}


def _metrics(server) -> tuple[str, dict]:
    r = server.http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}  # raises on invalid text
    return r.text, families


def _requests_ok(families, tenant: str, outcome: str = "ok") -> float:
    family = families.get("graphserve_requests")
    if family is None:
        return 0.0
    return sum(s.value for s in family.samples if s.labels.get("tenant") == tenant and s.labels["outcome"] == outcome)


def test_metrics_exposition(server, client):
    """/metrics is valid Prometheus text with the decode-step, request, TTFT and TPOT series,
    labelled as documented; a tenant-a request is counted under tenant="tenant-a"."""
    # replicas report every second: wait until earlier tests' requests are all in the count
    ok_before = settled(lambda: _requests_ok(_metrics(server)[1], "tenant-a"))
    cancelled_before = _requests_ok(_metrics(server)[1], "tenant-a", "cancelled")
    for _ in range(3):  # a stream the client reads to its end is ok, not cancelled (it leaves at the last chunk)
        stream = client.completions.create(model=server.model, prompt="hi", max_tokens=3, stream=True)
        assert [c.choices[0].finish_reason for c in stream][-1] in ("length", "stop")
    r = server.complete(tenant="tenant-a", max_tokens=6)
    assert r.status_code == 200

    def counted():
        text, families = _metrics(server)
        return (text, families) if _requests_ok(families, "tenant-a") >= ok_before + 4 else None

    text, families = wait_for(counted, 15, what="graphserve_requests_total{tenant='tenant-a'} to count the requests")
    assert _requests_ok(families, "tenant-a") == ok_before + 4
    assert _requests_ok(families, "tenant-a", "cancelled") == cancelled_before

    steps = families["graphserve_decode_steps"]
    assert steps.type == "counter"
    samples = [s for s in steps.samples if s.name == "graphserve_decode_steps_total"]
    assert samples, "no decode step series"
    for s in samples:
        assert set(s.labels) == STEP_LABELS, s.labels
        assert s.value >= 0
    assert sum(s.value for s in samples) >= 1
    assert "graphserve_decode_steps_total{" in text

    requests = [s for s in families["graphserve_requests"].samples if s.name == "graphserve_requests_total"]
    assert {s.labels["tenant"] for s in requests} >= {"tenant-a"}
    assert all(set(s.labels) == {"tenant", "outcome", "replica"} for s in requests)

    for name in ("graphserve_ttft_seconds", "graphserve_tpot_seconds"):
        family = families[name]
        assert family.type == "histogram"
        buckets = [s for s in family.samples if s.name == name + "_bucket"]
        assert buckets and all("le" in s.labels and "replica" in s.labels for s in buckets)
        assert any(s.labels["le"] == "+Inf" for s in buckets)
        count = next(s.value for s in family.samples if s.name == name + "_count")
        assert count >= 1
        assert f"{name}_bucket{{" in text
    ready = [s for s in families["graphserve_replica_ready"].samples]
    assert [s.value for s in ready] == [1.0]
    busy = families["graphserve_engine_busy_seconds"]
    assert busy.type == "counter"
    seconds = {s.labels["phase"]: s.value for s in busy.samples if s.name == "graphserve_engine_busy_seconds_total"}
    assert set(seconds) == {"prefill", "decode"} and seconds["prefill"] > 0 and seconds["decode"] > 0
    (pages,) = families["graphserve_kv_pages"].samples
    (free,) = families["graphserve_kv_pages_free"].samples
    assert pages.value > 0 and 0 <= free.value <= pages.value
    assert [s.value for s in families["graphserve_preemptions"].samples if s.name.endswith("_total")] == [0.0]


def test_metrics_leak_no_secrets(server):
    """Neither an API key nor the admin token appears in /metrics (or /admin/status)."""
    text, _ = _metrics(server)
    status = server.http.get("/admin/status", headers=server.admin_headers()).text
    for body in (text, status):
        for secret in (*API_KEYS.values(), ADMIN_TOKEN):
            assert secret not in body


def test_request_body_json_roundtrip_is_valid(server):
    """Non-streaming responses are a single JSON document (no SSE framing leaked into them)."""
    r = server.complete(max_tokens=3)
    assert r.headers["content-type"].startswith("application/json")
    assert json.loads(r.text)["object"] == "text_completion"


def test_openai_error_types(server):
    """The `type` field follows the status: 401 authentication_error, 404 not_found_error."""
    r = server.http.post("/v1/completions", json={}, headers={"Authorization": "Bearer nope"})
    assert assert_openai_error(r, 401)["type"] == "authentication_error"
    r = server.http.post(
        "/v1/completions", json={**_body(server, "completions", {}), "model": "x"}, headers=server.key_headers()
    )
    assert assert_openai_error(r, 404)["type"] == "not_found_error"


def test_status_reports_the_kv_pool_and_memory_apart(server):
    """/admin/status gives each replica's paged KV pool (pages, free pages, page size, the batch limit
    resolved for its device, preemptions) and its weights, KV pool and graphs memory separately."""
    status = server.replica_status()
    kv = status["kv_cache"]
    assert kv["page_size"] == 16 and kv["max_num_seqs"] == 32  # CPU: the default batch limit
    assert 0 < kv["pages_free"] <= kv["pages"] and kv["preemptions"] == 0
    memory = status["memory_mb"]
    assert set(memory) == {"weights", "kv_pool", "graphs"}
    assert memory["weights"] > 0 and memory["kv_pool"] > 0 and memory["graphs"] == 0  # no graphs on CPU
    assert status["attention_backend"] == "sdpa"  # auto, on CPU


def test_a_browser_page_of_an_allowed_origin_may_call_the_api(server):
    """CORS: the browser's preflight for a POST with an Authorization header is allowed for the
    configured origin and not for another; the answer to the call itself names the origin and
    exposes the seed header."""
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type",
    }
    r = httpx.options(server.v1 + "/chat/completions", headers={"origin": BROWSER_ORIGIN, **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == BROWSER_ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    other = httpx.options(server.v1 + "/chat/completions", headers={"origin": "https://evil.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 2}
    r = server.http.post("/v1/completions", json=body, headers={"origin": BROWSER_ORIGIN, **server.key_headers()})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == BROWSER_ORIGIN
    assert "x-graphserve-seed" in r.headers["access-control-expose-headers"]
