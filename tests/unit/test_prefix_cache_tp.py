"""Prefix caching with tensor parallelism (CPU, gloo, two processes): rank 0 decides which cached
pages a request reuses and ships them as block-table edits, as it ships every page; rank 1, which
holds its own shard of the same pages' K/V, reads the same ones. Requests that reuse pages decode
on two ranks what one process decodes with caching off."""

from __future__ import annotations

import pytest

from tests.unit.test_tp_startup import rank_engine, start_two_ranks
from workers.modeling.default_model import default_model_dir
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)
SYSTEM = list(range(30, 52))  # 22 tokens: five full pages of 4
PROMPTS = [SYSTEM + [7, 8], SYSTEM + [9], SYSTEM[:20]]
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
]


def config(model_dir: str, caching: bool) -> EngineConfig:
    return EngineConfig(
        model=model_dir, max_num_seqs=2, max_model_len=64, device="cpu", kv_page_size=4, enable_prefix_caching=caching
    )


def serve_in_turn(engine: LLMEngine) -> tuple[list[list[int]], list[int]]:
    seqs = []
    for prompt, params in zip(PROMPTS, PARAMS):
        seqs.append(engine.add_request(prompt, params))
        while engine.has_work():
            engine.step()
    return [s.output_ids for s in seqs], [s.cached_tokens for s in seqs]


def _serve(rank: int, port: int, model_dir: str) -> dict:
    engine = rank_engine(rank, port, config(model_dir, caching=True))
    if engine is None:
        return {}
    outputs, cached = serve_in_turn(engine)
    engine.stop_followers()
    return {"outputs": outputs, "cached": cached}


def test_two_ranks_reuse_the_same_pages_and_decode_what_one_uncached_process_does(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    model_dir = str(default_model_dir())
    results = start_two_ranks(model_dir, work=_serve)
    engine, _ = LLMEngine.from_config(config(model_dir, caching=False))
    outputs, _ = serve_in_turn(engine)
    assert results[0]["cached"] == [0, 20, 16]
    assert results[0]["outputs"] == outputs
