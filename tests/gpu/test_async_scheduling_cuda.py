"""Async scheduling on the GPU, where it overlaps for real: replayed graphs take the drawn tokens on
the device, the tokens reach the host through pinned copies and events. Token for token what the
synchronous engine decodes (fp32, tiny default model), under preemption, prefix sharing, every
way of sampling and ending, structured outputs and rows denied graphs."""

import pytest

from policies.graph_policy import GraphPolicy
from tests.unit.test_async_scheduling import assert_same_outcomes, drive, outcomes, workload
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", [0, 1])
def test_async_graph_steps_decode_what_synchronous_ones_decode(tmp_path, monkeypatch, seed):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    runs = {}
    for async_scheduling in (False, True):
        config = EngineConfig(
            max_num_seqs=8,
            max_model_len=64,
            device="cuda",
            dtype="float32",
            kv_page_size=8,
            kv_cache_tokens=160,
            graph_policy=GraphPolicy(compile=False),
            async_scheduling=async_scheduling,
        )
        engine, _ = LLMEngine.from_config(config)
        assert engine.runner.table.ready  # steps replay graphs
        seqs, tokens, logprobs = drive(engine, workload(seed))
        assert engine.status().kv_cache.preemptions > 0
        assert all(tokens[s.request_id] == s.output_ids for s in seqs)
        runs[async_scheduling] = outcomes(seqs, logprobs)
    assert_same_outcomes(runs[True], runs[False])
