"""The replica's engine path on a real GPU: the step loop in a child process captures its graphs,
replays them (the triton paged kernel, the `auto` backend on CUDA), and draws the same tokens as the
in-process eager engine (greedy and seeded sampling, an odd batch that pads to a bucket); its status
reports the KV pool and graph memory, with every page back once the requests are done."""

import asyncio

import pytest

from policies.graph_policy import GraphPolicy
from workers.front.engine_process import EngineProcess
from workers.modeling.checkpoint_dir import load_tokenizer
from workers.modeling.default_model import default_model_dir
from workers.protocol import Coalescing
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.gpu


def test_engine_process_replays_graphs_and_matches_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    config = EngineConfig(max_num_seqs=8, max_model_len=256, device="cuda", graph_policy=GraphPolicy(compile=False))
    prompts = [[256] + list(range(1 + i, 4 + 3 * i)) for i in range(5)]  # 5 rows: the bucket of 8 pads
    params = [
        SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=11 + i)
        for i in range(5)
    ]

    async def via_child() -> tuple[list[list[int]], dict]:
        engine = EngineProcess(config, load_tokenizer(default_model_dir()))
        try:

            async def one(prompt, p):
                out = []
                async for event in engine.submit(prompt, p, coalescing=Coalescing(0.005)):
                    out += event.token_ids
                return out

            outputs = await asyncio.gather(*(one(q, p) for q, p in zip(prompts, params)))
            return outputs, await engine.status()
        finally:
            engine.shutdown()

    outputs, status = asyncio.run(via_child())
    assert status.state == "READY" and all(b["ready"] for b in status.buckets.values())
    assert status.attention_backend == "triton"
    assert status.kv_cache.pages_free == status.kv_cache.pages > 0 and status.kv_cache.max_num_seqs == 8
    assert status.kv_cache.page_size == 16 and status.kv_cache.preemptions == 0
    assert status.memory_mb["kv_pool"] > 0 and status.memory_mb["graphs"] > 0 and status.memory_mb["weights"] > 0
    modes = {p["execution_mode"] for p in status.stats["decode_step_parts"]}
    assert modes == {"cuda_graph"}

    eager, _ = LLMEngine.from_config(
        EngineConfig(max_num_seqs=8, max_model_len=256, device="cuda", graph_policy=GraphPolicy(mode="eager"))
    )
    seqs = [eager.add_request(q, p) for q, p in zip(prompts, params)]
    while eager.has_work():
        eager.step()
    assert outputs == [s.output_ids for s in seqs]
