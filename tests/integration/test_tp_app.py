"""The Serve application with tensor_parallel_size 2 on CPU (gloo): the builder's placement group
holds the replica and one shard actor per rank, the replica turns READY once both ranks are up, and
the real openai client streams (coalesced) exactly what a single-process engine generates."""

from __future__ import annotations

import asyncio

import openai
import pytest
import ray

from tests.integration.helpers import API_KEYS, running_app
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(240)
MAX_MODEL_LEN = 128
PROMPTS = ["Hello, world", "The quick brown fox", "graphserve"]
TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = {"tensor_parallel_size": 2, "shard_num_cpus": 0.5, "max_model_len": MAX_MODEL_LEN}
    with running_app(tmp_path_factory.mktemp("tp-app"), name="tp", args=args, admin_token="admin-tp") as s:
        s.wait_ready(120)
        yield s


def single_process_texts() -> list[str]:
    """The same default checkpoint (the app's GRAPHSERVE_CACHE is set while the app runs) in one
    process, greedy, all prompts in one batch."""
    engine, tokenizer = LLMEngine.from_config(EngineConfig(max_model_len=MAX_MODEL_LEN, device="cpu"))
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(tokenizer(p)["input_ids"], params) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    return [tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in seqs]


async def streamed_texts(server) -> list[tuple[str, int]]:
    client = openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEYS["tenant-a"], max_retries=0, timeout=60)

    async def one(prompt: str) -> tuple[str, int]:
        stream = await client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, tokens = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, tokens

    return await asyncio.gather(*(one(p) for p in PROMPTS))


def shard_actors() -> list[str]:
    """Class names of the live shard actors (Ray's state API needs the dashboard, which these tests
    do not start; the GCS actor table does not)."""
    return [
        a["ActorClassName"]
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"] == "ShardWorker"
    ]


def test_tp2_app_streams_what_one_process_generates(server):
    (status,) = server.admin_status()["replicas"].values()
    assert status["state"] == "READY"
    assert len(shard_actors()) == 2  # really sharded: one actor per rank, not the single-process engine
    streamed = asyncio.run(streamed_texts(server))
    assert [tokens for _, tokens in streamed] == [TOKENS] * len(PROMPTS)
    assert [text for text, _ in streamed] == single_process_texts()
