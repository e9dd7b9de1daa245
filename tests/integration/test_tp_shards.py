"""Tensor-parallel shard actors on CPU (gloo): TP = 2 decodes what TP = 1 decodes, rank 0 screens
LoRA adapters against the group's slots, and a dead shard is noticed quickly without anything
hanging."""

import asyncio
import time

import pytest
import ray

from app.shards import ShardGroup
from policies.lora_slots import LoraLimits
from tests.lora_adapters import adapter_for
from tests.unit.conftest import make_hf_checkpoint
from workers.modeling.synthetic import build_byte_tokenizer
from workers.protocol import Coalescing, EngineRequest
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

STEPS = 32
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3], [256, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 100, 200]]
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"GRAPHSERVE_CACHE": str(cache)}})
    yield cache
    ray.shutdown()


def greedy_in_process(config: EngineConfig) -> list[list[int]]:
    engine, _ = LLMEngine.from_config(config)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


async def greedy_sharded(group: ShardGroup) -> list[list[int]]:
    async def one(i, prompt):
        tokens = []
        params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
        # reads every 10 ms, as the replica does: the tokens of several steps arrive as one event
        async for event in group.submit(EngineRequest(prompt, params, f"req-{i}", coalescing=Coalescing(0.01))):
            tokens += event.token_ids
        return tokens

    await group.start()
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))


def qwen2_checkpoint(path):
    """Qwen2-style (QKV bias) with a single KV head: with TP = 2 each rank holds a replica of it."""
    make_hf_checkpoint(path, "qwen2", seed=5, num_key_value_heads=1)
    build_byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp2_tokens_equal_tp1(ray_cluster, tmp_path, monkeypatch, family):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(ray_cluster))
    model = qwen2_checkpoint(tmp_path) if family == "qwen2" else None
    config = EngineConfig(model=model, max_num_seqs=4, max_model_len=128, device="cpu")
    group = ShardGroup(config, world_size=2, num_gpus=0, num_cpus=0.5, timeout_s=20)
    sharded = asyncio.run(greedy_sharded(group))
    assert sharded == greedy_in_process(config)
    assert all(len(t) == STEPS for t in sharded)


def test_rank0_screens_adapters_against_the_groups_slots(ray_cluster, tmp_path, monkeypatch):
    """What a replica asks a TP group after a restart: which served adapters its slots refuse, and
    why (the reason a load would give), answered by rank 0 without loading any."""
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(ray_cluster))
    base = tmp_path / "base"
    make_hf_checkpoint(base, "llama", seed=3)
    build_byte_tokenizer().save_pretrained(base)
    served = {
        "fits": str(adapter_for(base, tmp_path / "fits", seed=1, r=4, target_modules=["q_proj", "v_proj"])),
        "wide": str(adapter_for(base, tmp_path / "wide", seed=2, r=8, target_modules=["q_proj", "v_proj"])),
        "gone": str(tmp_path / "nonexistent"),
    }
    lora = LoraLimits(max_loras=2, max_lora_rank=4)
    config = EngineConfig(model=str(base), max_num_seqs=2, max_model_len=128, device="cpu", lora=lora)
    group = ShardGroup(config, world_size=2, num_gpus=0, num_cpus=0.5, timeout_s=20)

    async def screen():
        await group.start()
        return await group.screen_adapters(served)

    refused = asyncio.run(asyncio.wait_for(screen(), timeout=120))
    assert set(refused) == {"wide", "gone"}
    assert refused["wide"] == "r: rank 8 is above max_lora_rank 4"
    assert "no adapter_config.json" in refused["gone"]


def test_dead_shard_is_noticed_and_nothing_hangs(ray_cluster, monkeypatch):
    """Killing rank 1 fails the group's health check at once, and a request in flight ends with an
    error within the collective timeout instead of waiting forever."""
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(ray_cluster))
    config = EngineConfig(max_num_seqs=2, max_model_len=128, device="cpu")
    group = ShardGroup(config, world_size=2, num_gpus=0, num_cpus=0.5, timeout_s=5)

    async def scenario():
        await group.start()
        await group.check()
        params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        stream = group.submit(EngineRequest(PROMPTS[0], params, "long"))
        await anext(stream)
        ray.kill(group.shards[1])
        t0 = time.monotonic()
        while True:  # ray.kill is asynchronous: a ping sent at once may still be answered
            try:
                await group.check()
            except (ray.exceptions.RayError, RuntimeError):
                break
            await asyncio.sleep(0.1)
        noticed = time.monotonic() - t0
        with pytest.raises((ray.exceptions.RayError, RuntimeError)):  # EngineDeadError is a RuntimeError
            async for _ in stream:
                pass
        return noticed, time.monotonic() - t0

    noticed, ended = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert noticed < 5.0
    assert ended < 30.0
