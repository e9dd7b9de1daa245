"""Tensor parallelism over two GPUs with NCCL (the nvidia-h200-x2 machine): both shard actors
capture every decode bucket, replaying them gives eager's tokens, TP = 2 gives TP = 1's tokens, and
the Serve app with tensor_parallel_size 2 is RUNNING only once both shards captured.

Replayed graphs that lacked their all-reduce would sum nothing across ranks and decode other tokens
than eager and TP = 1 do, so the token comparisons also show the all-reduce is inside the graphs."""

import asyncio
import time

import pytest
import torch

from policies.graph_policy import GraphPolicy
from workers.protocol import EngineRequest
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
    pytest.mark.timeout(600),
]
ray = pytest.importorskip("ray")

STEPS = 64
MAX_MODEL_LEN = 256
# 3 rows (no bucket of its own: replays bucket 4, padded) and 8 rows (a bucket).
BATCHES = {
    3: [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9], [256, 200]],
    8: [[256, *range(10 + i, 20 + 3 * i)] for i in range(8)],
}
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def config(mode: str, **kv) -> EngineConfig:
    policy = GraphPolicy(mode=mode, compile=False)
    return EngineConfig(max_num_seqs=8, max_model_len=MAX_MODEL_LEN, device="cuda", graph_policy=policy, **kv)


def tp1_tokens(prompts: list[list[int]], **kv) -> list[list[int]]:
    engine, _ = LLMEngine.from_config(config("eager", **kv))
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def sharded_tokens(group, prompts: list[list[int]]) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        out = []
        async for event in group.submit(EngineRequest(prompt, GREEDY, f"r{i}-{len(prompts)}")):
            out += event.token_ids
        return out

    async def run_all():
        await group.start()
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(run_all())


@pytest.fixture(scope="module")
def ray_two_gpus(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    ray.init(
        num_cpus=8, num_gpus=2, include_dashboard=False, runtime_env={"env_vars": {"GRAPHSERVE_CACHE": str(cache)}}
    )
    yield cache
    ray.shutdown()


def test_tp2_graphs_on_both_ranks_match_eager_and_tp1(ray_two_gpus, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(ray_two_gpus))
    from app.shards import ShardGroup

    results = {}
    for mode in ("full", "eager"):
        group = ShardGroup(config(mode), world_size=2, num_gpus=1, num_cpus=1, timeout_s=60)
        results[mode] = {bs: sharded_tokens(group, prompts) for bs, prompts in BATCHES.items()}
        status = asyncio.run(group.status())
        if mode == "full":
            assert [s["rank"] for s in status.shards] == [0, 1]
            for shard in status.shards:
                assert all(b["ready"] for b in shard["buckets"].values()), shard
            modes = {p["execution_mode"] for p in status.stats["decode_step_parts"]}
            assert modes == {"cuda_graph"}
        for shard in group.shards:
            ray.kill(shard)
    for bs, prompts in BATCHES.items():
        assert results["full"][bs] == results["eager"][bs], f"graph != eager at TP = 2, batch {bs}"
        assert results["full"][bs] == tp1_tokens(prompts), f"TP = 2 != TP = 1, batch {bs}"
        assert all(len(t) == STEPS for t in results["full"][bs])


def test_tp2_preemption_in_a_small_pool_matches_tp1(ray_two_gpus, monkeypatch):
    """A pool of 16 pages for 8 sequences growing to ~6 pages each: rank 0's block manager preempts
    and re-prefills, and both ranks follow its block-table edits. TP = 2 replaying graphs gives the
    tokens of TP = 1 with the same small pool and of TP = 1 with an ample one."""
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(ray_two_gpus))
    from app.shards import ShardGroup

    small = dict(kv_page_size=16, kv_cache_tokens=MAX_MODEL_LEN)
    prompts = BATCHES[8]
    group = ShardGroup(config("full", **small), world_size=2, num_gpus=1, num_cpus=1, timeout_s=60)
    tokens = sharded_tokens(group, prompts)
    status = asyncio.run(group.status())
    for shard in group.shards:
        ray.kill(shard)
    assert status.kv_cache.preemptions > 0 and status.kv_cache.pages == 16
    assert status.kv_cache.pages_free == status.kv_cache.pages
    assert {p["execution_mode"] for p in status.stats["decode_step_parts"]} == {"cuda_graph"}
    assert tokens == tp1_tokens(prompts, **small) == tp1_tokens(prompts)
    assert all(len(t) == STEPS for t in tokens)


def test_tp2_app_is_running_only_after_both_shards_captured(tmp_path):
    import openai

    from tests.integration.helpers import API_KEYS, running_app

    args = {"tensor_parallel_size": 2, "accelerator": "gpu", "shard_num_cpus": 1, "max_model_len": MAX_MODEL_LEN}
    with running_app(tmp_path, name="tp2-gpu", args=args, admin_token="admin-tp2") as server:
        running_at = time.time()  # serve.run returned: the app is RUNNING
        assert server.is_ready()
        (status,) = server.admin_status()["replicas"].values()
        assert status["state"] == "READY"
        assert len(status["shards"]) == 2
        for shard in status["shards"]:
            assert all(b["ready"] for b in shard["buckets"].values()), shard
            assert shard["captured_at"] < running_at

        client = openai.OpenAI(base_url=server.v1, api_key=API_KEYS["tenant-a"], max_retries=0, timeout=60)
        stream = client.completions.create(
            model=server.model,
            prompt="Hello",
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 32
        assert sum(1 for c in chunks if c.choices) > 1  # streamed, not one block
