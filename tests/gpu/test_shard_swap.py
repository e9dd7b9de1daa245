"""Model swaps through the shard-actor path (the one tensor parallelism uses) on real GPUs with
captured graphs: TP = 1 on one GPU, TP = 2 where two exist. A checkpoint of the same shapes loads
in place on every rank and decodes, through the graphs, what a fresh eager engine decodes on it; a
NaN checkpoint fails the gate and every rank serves the old weights again through its graphs; a
checkpoint of other shapes rebuilds every shard actor."""

import asyncio
import itertools

import pytest
import torch
from safetensors.torch import load_file, save_file

from policies.graph_policy import GraphPolicy
from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint
from workers.protocol import EngineRequest
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ray = pytest.importorskip("ray")

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9], [256, 200]]  # 3 rows: bucket 4, padded
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
REQUEST_IDS = itertools.count()
WORLD_SIZES = [1, pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shard-swap")
    tokenizer = build_byte_tokenizer()
    shape = tiny_hf_config(len(tokenizer))
    paths = {
        name: write_checkpoint(tmp / name, shape, tokenizer, seed=seed)
        for name, seed in (("v1", 31), ("v2", 32), ("nan", 33))
    }
    state = load_file(paths["nan"] / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"][:, 3] = float("nan")
    save_file(state, paths["nan"] / "model.safetensors", metadata={"format": "pt"})
    wide = {**shape, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}
    paths["wide"] = write_checkpoint(tmp / "wide", wide, tokenizer, seed=34)
    return paths


def config(path, mode: str = "full") -> EngineConfig:
    policy = GraphPolicy(mode=mode, decode_batch_buckets=[1, 4, 8], compile=False)
    return EngineConfig(model=str(path), max_num_seqs=8, max_model_len=256, device="cuda", graph_policy=policy)


def eager_tokens(path) -> list[list[int]]:
    engine, _ = LLMEngine.from_config(config(path, "eager"))
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


async def decode(group) -> list[list[int]]:
    async def one(prompt: list[int]) -> list[int]:
        out = []
        async for event in group.submit(EngineRequest(prompt, GREEDY, f"r{next(REQUEST_IDS)}")):
            out += event.token_ids
        return out

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


async def graph_steps_only(group) -> None:
    status = await group.status()
    for shard in status.shards:
        assert all(b["ready"] for b in shard["buckets"].values()), shard
    assert {p["execution_mode"] for p in status.stats["decode_step_parts"]} == {"cuda_graph"}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_swaps_on_every_rank(checkpoints, tmp_path, world_size):
    from app.shards import ShardGroup, SwapFailed

    expected = {name: eager_tokens(checkpoints[name]) for name in ("v1", "v2", "wide")}
    ray.init(num_cpus=8, num_gpus=world_size, include_dashboard=False)

    async def scenario():
        group = ShardGroup(config(checkpoints["v1"]), world_size, num_gpus=1, num_cpus=1, timeout_s=60)
        await group.start()
        assert await decode(group) == expected["v1"]
        report = await group.swap(config(checkpoints["v2"]))
        assert report["path"] == "in_place" and report["buckets"] == 3
        assert await decode(group) == expected["v2"]
        await graph_steps_only(group)
        with pytest.raises(SwapFailed, match="not finite"):
            await group.swap(config(checkpoints["nan"]))
        assert await decode(group) == expected["v2"]  # every rank has its v2 shard back
        await graph_steps_only(group)
        report = await group.swap(config(checkpoints["wide"]))
        assert report["path"] == "rebuild"
        assert await decode(group) == expected["wide"]
        await graph_steps_only(group)
        await group.close()

    try:
        asyncio.run(scenario())
    finally:
        ray.shutdown()
