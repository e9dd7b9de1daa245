"""The engine on a real GPU agrees with itself on the CPU: same checkpoint, same tokens, also when a
small KV pool makes both preempt and prefill again."""

import pytest
import torch

from policies.graph_policy import GraphPolicy
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.gpu
UNCOMPILED = GraphPolicy(compile=False)


def run(device: str, requests: list[tuple[list[int], SamplingParams]], **config) -> tuple[list[list[int]], dict]:
    config = EngineConfig(max_num_seqs=8, max_model_len=128, device=device, graph_policy=UNCOMPILED, **config)
    engine, _ = LLMEngine.from_config(config)
    assert engine.model.attention_backend.name == ("triton" if device == "cuda" else "sdpa")  # `auto`
    seqs = [engine.add_request(ids, params) for ids, params in requests]
    streamed = {s.request_id: [] for s in seqs}
    while engine.has_work():
        for event in engine.step():
            streamed[event.request_id] += event.token_ids
    assert all(streamed[s.request_id] == s.output_ids for s in seqs)
    return [s.output_ids for s in seqs], engine.status().kv_cache


@pytest.mark.parametrize("pool", [None, 8 * 16], ids=["ample-pool", "small-pool"])
def test_cuda_matches_cpu_greedy_and_seeded(tmp_path, monkeypatch, pool):
    """Greedy and seeded sampling draw identical tokens on CUDA (triton kernel, graphs) and CPU
    (sdpa, eager) (fp32, tiny default model): the counter-based sampler has no device-specific
    state, and paging decisions are the scheduler's, the same on both: with a pool of 8 pages both
    preempt the same number of times."""
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    requests = []
    for i in range(7):
        prompt = torch.randint(0, 256, (5 + 9 * i,), generator=g).tolist()
        params = SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=100 + i)
        requests.append((prompt, params))
    cuda, cuda_kv = run("cuda", requests, kv_cache_tokens=pool)
    cpu, cpu_kv = run("cpu", requests, kv_cache_tokens=pool)
    assert cuda == cpu
    assert cuda_kv.preemptions == cpu_kv.preemptions
    assert (cuda_kv.preemptions > 0) == (pool is not None)
    assert cuda_kv.pages_free == cuda_kv.pages
