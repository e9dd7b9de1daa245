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


def test_the_controller_is_never_placed_in_a_replicas_placement_group(server, tmp_path):
    """Whichever part asks first creates the controller: a TP replica (its placement group captures
    the actors it creates) put it in its own group, and when that replica died the controller was
    restarted into a group that no longer existed, for good (/admin and /metrics answered 503)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 0.01}])
    ray.get(group.ready(), timeout=30)
    args = {"controller_name": f"graphserve-it-pg-{tmp_path.name}", "controller_state_path": str(tmp_path / "s.json")}

    @ray.remote(num_cpus=0.01)
    def create_controller(args: dict) -> str | None:
        from app.config import AppConfig
        from app.controller import controller_handle

        handle = controller_handle(AppConfig.from_args(args))
        return ray.get(handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_placement_group_id()))

    inside = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
    try:
        assert ray.get(create_controller.options(scheduling_strategy=inside).remote(args), timeout=60) is None
    finally:
        ray.kill(ray.get_actor(args["controller_name"], namespace="graphserve"))
        remove_placement_group(group)
