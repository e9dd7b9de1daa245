"""Nothing a client sends may produce a 5xx (issue 12): raw bodies that json.loads would accept but no
tokenizer can take (lone UTF-16 surrogates), non-finite numbers, numbers sent as strings, a stop string
over the cap, a chat template that refuses the conversation and a response_format schema that cannot
be compiled are each a 400 in OpenAI's error shape, and the server goes on serving.

One Ray instance for the module, serving the tiny model from a checkpoint of its own whose chat
template, like Llama 2's or Mistral's, raises unless roles alternate user/assistant.
"""

from __future__ import annotations

import json
import uuid

import openai
import pytest

from app.openai_protocol import STOP_MAX_CHARS
from tests.chat_templates import ALTERNATE, ALTERNATING_TEMPLATE
from tests.integration.helpers import assert_openai_error, openai_client, running_app
from workers.modeling.synthetic import TINY_SEED, build_byte_tokenizer, tiny_hf_config, write_checkpoint

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-alternating"
ADMIN_TOKEN = "admin-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = ALTERNATING_TEMPLATE
    checkpoint = write_checkpoint(tmp / MODEL, tiny_hf_config(len(tokenizer)), tokenizer, TINY_SEED)
    args = {"model": str(checkpoint), "served_model_name": MODEL}
    with running_app(tmp, name="bad-input", args=args, admin_token=ADMIN_TOKEN) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


M = json.dumps(MODEL)
USER_HI = '[{"role": "user", "content": "hi"}]'
SCHEMA = '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '  # + schema + "}}"
# (case id, endpoint, raw body with {m} for the model, words the error message must contain). Raw text:
# json.dumps would escape what these send, or refuse to write it (NaN with allow_nan=False).
RAW_BODIES = [
    ("prompt-high-surrogate", "completions", r'{"model": {m}, "prompt": "\ud800"}', ["surrogate"]),
    ("prompt-low-surrogate", "completions", r'{"model": {m}, "prompt": "ok \udfff ok"}', ["surrogate"]),
    ("prompt-two-highs", "completions", r'{"model": {m}, "prompt": "\ud800\ud800"}', ["surrogate"]),
    ("content-surrogate", "chat", r'{"model": {m}, "messages": [{"role": "user", "content": "\ud800"}]}',
     ["surrogate"]),
    ("name-surrogate", "chat", r'{"model": {m}, "messages": [{"role": "user", "content": "a", "name": "\udc00"}]}',
     ["surrogate"]),
    ("stop-surrogate", "completions", r'{"model": {m}, "prompt": "hi", "stop": ["\ud83d"]}', ["surrogate"]),
    ("model-surrogate", "completions", r'{"model": "tiny\ud800", "prompt": "hi"}', ["surrogate"]),
    ("temperature-nan", "completions", '{"model": {m}, "prompt": "hi", "temperature": NaN}', ["NaN"]),
    ("top_p-infinity", "completions", '{"model": {m}, "prompt": "hi", "top_p": Infinity}', ["Infinity"]),
    ("seed-minus-infinity", "chat", '{"model": {m}, "messages": ' + USER_HI + ', "seed": -Infinity}', ["NaN"]),
    ("temperature-overflow", "completions", '{"model": {m}, "prompt": "hi", "temperature": 1e999}', ["temperature"]),
    ("nested-300-deep", "completions", '{"model": {m}, "prompt": "hi", "user": ' + "[" * 300 + "]" * 300 + "}",
     ["nested too deeply", "201 levels"]),
    ("seed-5000-digits", "completions", '{"model": {m}, "prompt": "hi", "seed": ' + "9" * 5000 + "}", ["JSON"]),
    ("temperature-string", "completions", '{"model": {m}, "prompt": "hi", "temperature": "1.5"}', ["temperature"]),
    ("top_p-string", "chat", '{"model": {m}, "messages": ' + USER_HI + ', "top_p": "0.5"}', ["top_p"]),
    ("max_tokens-true", "completions", '{"model": {m}, "prompt": "hi", "max_tokens": true}', ["max_tokens"]),
    ("n-true", "completions", '{"model": {m}, "prompt": "hi", "n": true}', ["n"]),
    ("content-number", "chat", '{"model": {m}, "messages": [{"role": "user", "content": 5}]}', ["content"]),
    ("stop-over-cap", "completions", '{"model": {m}, "prompt": "hi", "stop": "' + "x" * (STOP_MAX_CHARS + 1) + '"}',
     ["stop", str(STOP_MAX_CHARS)]),
    ("roles-not-alternating", "chat",
     '{"model": {m}, "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}', [ALTERNATE]),
    ("roles-not-alternating-streamed", "chat",
     '{"model": {m}, "stream": true, "messages": [{"role": "assistant", "content": "a"}]}', ["alternate"]),
    ("schema-unknown-format", "chat", '{"model": {m}, "messages": ' + USER_HI + ', ' + SCHEMA +
     '{"type": "string", "format": "bogus"}}}}', ["response_format", "Unknown format: bogus"]),
    ("schema-unsatisfiable", "completions", '{"model": {m}, "prompt": "hi", ' + SCHEMA +
     '{"type": "integer", "minimum": 3, "maximum": 1}}}}', ["response_format", "minimum (3)"]),
    # passes the ingress's tokenizer-free check; the replica's compile finds that no document fits
    ("schema-self-reference-streamed", "chat", '{"model": {m}, "stream": true, "messages": ' + USER_HI + ', ' +
     SCHEMA + '{"$ref": "#"}}}}', ["no document satisfies"]),
    ("response-format-type", "completions", '{"model": {m}, "prompt": "hi", "response_format": {"type": "regex"}}',
     ["response_format", "json_schema"]),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "raw", "needles"), [c[1:] for c in RAW_BODIES], ids=[c[0] for c in RAW_BODIES])
def test_bad_input_is_400_and_the_server_goes_on(server, endpoint, raw, needles):
    """Each body is a 400 in OpenAI's error shape naming what is wrong; the next normal request is
    served."""
    path = f"/v1/{'chat/' if endpoint == 'chat' else ''}completions"
    headers = {**server.key_headers(), "Content-Type": "application/json"}
    r = server.http.post(path, content=raw.replace("{m}", M).encode(), headers=headers)
    error = assert_openai_error(r, 400, *needles)
    assert error["type"] == "invalid_request_error"
    if "response_format" in raw:
        assert error["param"] == "response_format", error
    after = server.complete(max_tokens=2)
    assert after.status_code == 200, after.text


def test_openai_client_gets_bad_request(server, client):
    """Through the real client (which cannot send a lone surrogate or NaN at all): BadRequestError with
    our message, never an InternalServerError."""
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"temperature": "1.5"})
    with pytest.raises(openai.BadRequestError, match="alternate"):
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "assistant", "content": "c"},
            ],
            max_tokens=2,
        )
    with pytest.raises(openai.BadRequestError, match="stop"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stop=["y" * (STOP_MAX_CHARS + 1)])
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        max_tokens=3,
        temperature=0,
    )
    assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens >= 1


def test_stop_strings_at_the_cap_are_served(server, client):
    """Four stop strings of the maximal length that never match leave a greedy completion as it is
    without them, streamed or not."""
    stops = [c * STOP_MAX_CHARS for c in "\x01\x02\x03\x04"]
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=64, temperature=0)
    cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=64, temperature=0, stop=stops)
    assert cut.choices[0].text == plain.choices[0].text
    assert cut.choices[0].finish_reason == plain.choices[0].finish_reason
    chunks = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=64, temperature=0, stop=stops, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text


@pytest.mark.parametrize(
    "raw", [rb'{"cuda_graph": "\ud800"}', b'{"cuda_graph": NaN}', b"[true]"], ids=["surrogate", "nan", "array"]
)
def test_admin_toggle_bad_body_is_400(server, raw):
    """The admin API shares the strict body parsing; its errors keep the admin API's `detail` shape."""
    headers = {**server.admin_headers(), "Content-Type": "application/json"}
    r = server.http.put("/admin/tenants/tenant-a/cuda-graph", content=raw, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["detail"].startswith('request body must be a JSON object: {"cuda_graph": true|false} (')
    ok = server.http.put("/admin/tenants/tenant-a/cuda-graph", json={"cuda_graph": True}, headers=headers)
    assert ok.status_code == 200, ok.text
