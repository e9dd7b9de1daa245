"""The engine on a real GPU agrees with itself on the CPU: same checkpoint, same tokens."""

import pytest
import torch

from workers.engine import EngineConfig, LLMEngine
from workers.sampling import SamplingParams

pytestmark = pytest.mark.gpu


def run(device: str, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    engine, _ = LLMEngine.from_config(EngineConfig(max_num_seqs=8, max_model_len=256, device=device))
    seqs = [engine.add_request(ids, params) for ids, params in requests]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def test_cuda_matches_cpu_greedy_and_seeded(tmp_path, monkeypatch):
    """Greedy and seeded sampling draw identical tokens on CUDA and CPU (fp32, tiny default
    model): the counter-based sampler has no device-specific state."""
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    requests = []
    for i in range(7):
        prompt = torch.randint(0, 256, (5 + 9 * i,), generator=g).tolist()
        params = SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=100 + i)
        requests.append((prompt, params))
    assert run("cuda", requests) == run("cpu", requests)
