"""response_format end to end: the real openai client's `parse` (a Pydantic model sent as a strict
json_schema) against SmolLM2 served by the app, json_object mode, /v1/completions, streams of
several seeded choices with logprobs, and a schema that cannot be compiled. Every schema bounds its
strings and arrays, so the 135M model finishes its JSON in a few dozen tokens; the requests of a
test run side by side (their steps are shared), which keeps the module to about a minute on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import json
from enum import Enum
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from tests.integration.helpers import API_KEYS, running_app
from tests.smollm2 import smollm2_cache
from workers.modeling.default_model import DEFAULT_MODEL_ENV, SMOLLM2_NAME

pytestmark = pytest.mark.timeout(300)
READY_S = 120
MAX_TOKENS = 160


class Capital(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Species(str, Enum):
    cat = "cat"
    dog = "dog"
    parrot = "parrot"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    species: Species
    age: int = Field(ge=0, le=30)
    toys: list[Annotated[str, Field(max_length=12)]] = Field(max_length=2)


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    address: Address
    role: Literal["owner", "tenant"]
    nickname: str | None = Field(max_length=12)


QUESTIONS = {
    Capital: "What is the capital of France? Answer in JSON.",
    Pet: "Describe a pet as JSON.",
    Person: "Describe a person who lives in Rome, as JSON.",
}


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {DEFAULT_MODEL_ENV: "smollm2", "GRAPHSERVE_CACHE": str(smollm2_cache(tmp_path_factory))}
    with running_app(
        tmp_path_factory.mktemp("structured"), name="structured", args={"max_model_len": 512}, extra_env=env
    ) as app:
        app.wait_ready(READY_S)
        yield app


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.v1, api_key=API_KEYS["tenant-a"], max_retries=0, timeout=240) as c:
        yield c


def parse(client: openai.OpenAI, model: type[BaseModel]):
    """`chat.completions.parse` where the client has it, else its older `beta` home."""
    completions = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    return completions(
        model=SMOLLM2_NAME, messages=ask(QUESTIONS[model]), response_format=model, max_tokens=MAX_TOKENS, temperature=0
    )


def side_by_side(*calls):
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def test_parse_returns_each_pydantic_model_and_json_object_mode_returns_json(client):
    """Nested objects, an enum, a bounded array, a Literal, a nullable field, all required: the
    content validates against the schema the client sent, and the client's parse succeeds."""
    models = list(QUESTIONS)
    *parsed, loose = side_by_side(
        *[lambda m=m: parse(client, m) for m in models],
        lambda: client.chat.completions.create(
            model=SMOLLM2_NAME,
            # an open question ("Give me a JSON object describing Paris.") sends greedy SmolLM2 into
            # endless nesting within the grammar ({"data": {"data": ...) on today's packages: the
            # model's choice, not the grammar's; keys named in the prompt keep it to a short object
            messages=ask("Describe Paris as a JSON object with the keys city and country."),
            response_format={"type": "json_object"},
            max_tokens=MAX_TOKENS,
            temperature=0,
        ),
    )
    for model, completion in zip(models, parsed):
        (choice,) = completion.choices
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, model), choice.message.content
        jsonschema.validate(json.loads(choice.message.content), to_strict_json_schema(model))
    assert "Paris" in parsed[0].choices[0].message.content
    assert loose.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(loose.choices[0].message.content), dict), loose.choices[0].message.content


def test_completions_streamed_choices_with_seeds_and_logprobs_follow_the_schema(client):
    """/v1/completions takes response_format too (as vLLM); two seeded sampled choices, streamed,
    each its own grammar; every token's logprob is of the constrained distribution (<= 0, and the
    alternatives listed are tokens the grammar allowed: finite)."""
    schema = to_strict_json_schema(Pet)
    stream = client.completions.create(
        model=SMOLLM2_NAME,
        prompt="A pet, as JSON: ",
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=7,
        n=2,
        logprobs=2,
        stream=True,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "Pet", "schema": schema}}},
    )
    texts, reasons, logprobs = ["", ""], [None, None], [[], []]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
            logprobs[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
    assert reasons == ["stop", "stop"], texts
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert texts[0] != texts[1]  # two choices, two seeds
    assert all(-30 < lp <= 0 for lp in logprobs[0] + logprobs[1])


def test_a_schema_that_cannot_be_compiled_is_a_bad_request_naming_the_reason(client):
    bad = {"type": "json_schema", "json_schema": {"name": "Bad", "schema": {"type": "string", "format": "bogus"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SMOLLM2_NAME, messages=ask("hi"), response_format=bad, max_tokens=8)
    assert info.value.param == "response_format" and "Unknown format: bogus" in info.value.message
    with pytest.raises(openai.BadRequestError, match="json_object"):
        client.chat.completions.create(model=SMOLLM2_NAME, messages=ask("hi"), response_format={"type": "xml"})
