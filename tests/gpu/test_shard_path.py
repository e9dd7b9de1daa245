"""The shard-actor path (the one tensor parallelism uses) on a real GPU with TP = 1: the rank-0
actor captures its graphs and decodes the same tokens as the in-process eager engine."""

import asyncio

import pytest

from workers.protocol import EngineRequest
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.gpu
ray = pytest.importorskip("ray")


def test_shard_actor_tp1_captures_and_matches_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    from app.shards import ShardGroup
    from policies.graph_policy import GraphPolicy

    ray.init(
        num_cpus=4, num_gpus=1, include_dashboard=False, runtime_env={"env_vars": {"GRAPHSERVE_CACHE": str(tmp_path)}}
    )
    try:
        config = EngineConfig(max_num_seqs=8, max_model_len=256, device="cuda", graph_policy=GraphPolicy(compile=False))
        group = ShardGroup(config, world_size=1, num_gpus=1, num_cpus=1, timeout_s=30)
        status = ray.get(group.rank0.status.remote())
        assert status.state == "READY"
        assert all(b["ready"] for b in status.buckets.values())

        prompts = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9], [256, 200]]
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

        async def run_all():
            async def one(i, p):
                out = []
                async for event in group.submit(EngineRequest(p, params, f"r{i}")):
                    out += event.token_ids
                return out

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        via_actor = asyncio.run(run_all())
        eager, _ = LLMEngine.from_config(
            EngineConfig(max_num_seqs=8, max_model_len=256, device="cuda", graph_policy=GraphPolicy(mode="eager"))
        )
        seqs = [eager.add_request(p, params) for p in prompts]
        while eager.has_work():
            eager.step()
        assert via_actor == [s.output_ids for s in seqs]
        status = ray.get(group.rank0.status.remote())
        assert {p["execution_mode"] for p in status.stats["decode_step_parts"]} == {"cuda_graph"}
        assert status.kv_cache.pages_free == status.kv_cache.pages > 0
    finally:
        ray.shutdown()
