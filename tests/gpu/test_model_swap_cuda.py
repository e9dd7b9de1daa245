"""In-place model swaps with real CUDA graphs: new weights of the same shapes are copied into the
parameters the graphs read (no address changes, no recapture), pass the gate, and decode through
the graphs what eager decoding and a freshly started engine decode on them. Two faults the gate must
catch, each leaving the old model serving through its graphs: a parameter moved to new storage (a
graph would go on reading the freed one) and a captured bucket whose replay drifts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policies.dispatch import FallbackReason
from policies.graph_policy import GraphPolicy
from tests.gpu.test_graph_runner import requests, run
from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint
from workers.serving import model_gate
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.model_gate import GateFailed, swap_weights_in_place

pytestmark = pytest.mark.gpu
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-swap")
    tokenizer = build_byte_tokenizer()
    shape = tiny_hf_config(len(tokenizer))
    return {seed: write_checkpoint(tmp / f"w{seed}", shape, tokenizer, seed=seed) for seed in (21, 22)}


def engine_on(path) -> LLMEngine:
    policy = GraphPolicy(decode_batch_buckets=BUCKETS, compile=False)
    config = EngineConfig(
        model=str(path),
        max_num_seqs=8,
        max_model_len=256,
        device="cuda",
        attention_backend="triton",
        graph_policy=policy,
    )
    return LLMEngine.from_config(config)[0]


def outputs(engine: LLMEngine, denials=None) -> list[list[int]]:
    trace = run(engine, requests(7, seed=41, max_tokens=24), denials=denials)
    return [trace.outputs[f"r{i}"] for i in range(7)]


def addresses(engine: LLMEngine) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in engine.model.named_parameters()}


def test_in_place_swap_keeps_addresses_and_decodes_the_new_model(checkpoints):
    engine = engine_on(checkpoints[21])
    before, ptrs, graphs = outputs(engine), addresses(engine), dict(engine.runner._graphs)
    _, report = swap_weights_in_place(engine, dataclasses.replace(engine.config, model=str(checkpoints[22])))
    assert report["buckets"] == len(BUCKETS) and addresses(engine) == ptrs
    assert engine.runner._graphs == graphs and engine.runner.table.ready == set(BUCKETS)  # no recapture
    after = outputs(engine)
    eager = outputs(engine, denials=[FallbackReason.DISABLED] * 7)
    assert after == eager == outputs(engine_on(checkpoints[22])) and after != before
    parts = {p["execution_mode"] for p in engine.stats.snapshot()["decode_step_parts"]}
    assert "cuda_graph" in parts


def test_a_moved_parameter_is_caught_and_the_old_model_serves(checkpoints, monkeypatch):
    engine = engine_on(checkpoints[21])
    before, ptrs = outputs(engine), addresses(engine)
    load = model_gate.load_weights

    def load_then_move(model, model_dir):
        load(model, model_dir)
        model.layers[0].mlp.down.weight.data = model.layers[0].mlp.down.weight.data.clone()

    monkeypatch.setattr(model_gate, "load_weights", load_then_move)
    with pytest.raises(GateFailed, match="moved to new storage"):
        swap_weights_in_place(engine, dataclasses.replace(engine.config, model=str(checkpoints[22])))
    assert addresses(engine) == ptrs and outputs(engine) == before
    assert engine.runner.table.ready == set(BUCKETS)


def test_a_drifting_replay_fails_the_gate_and_the_old_model_serves(checkpoints):
    engine = engine_on(checkpoints[21])
    before = outputs(engine)
    graph = engine.runner._replays[4]

    def drifting() -> torch.Tensor:
        out = graph()
        out[:, :8] += 1e4
        return out

    engine.runner._replays[4] = drifting
    with pytest.raises(GateFailed, match="decode_bs_4"):
        swap_weights_in_place(engine, dataclasses.replace(engine.config, model=str(checkpoints[22])))
    engine.runner._replays[4] = graph
    assert outputs(engine) == before and engine.runner.table.ready == set(BUCKETS)
