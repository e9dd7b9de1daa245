"""response_format on a real GPU: the masks go through pinned host memory and are applied after the
replayed graph, which stays as it was captured (rows under a schema replay like any other); a
mixed batch gives its free rows exactly the tokens of a batch without schemas, and the constrained
rows what the CPU draws for them (tiny default model, fp32)."""

import json

import pytest
import torch

from policies.graph_policy import GraphPolicy
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.grammar import canonical_schema
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.gpu
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["kind", "n"],
    "additionalProperties": False,
}


def requests(constrained: bool) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        prompt = torch.randint(0, 256, (5 + 3 * i,), generator=g).tolist()
        schema = canonical_schema(SCHEMA) if constrained and i % 2 else None
        sampling = dict(temperature=0.0) if i % 4 < 2 else dict(temperature=0.9, top_p=0.9, seed=100 + i)
        out.append((prompt, SamplingParams(max_tokens=30, ignore_eos=schema is None, json_schema=schema, **sampling)))
    return out


def run(device: str, batch: list[tuple[list[int], SamplingParams]]) -> tuple[list, dict, object]:
    config = EngineConfig(max_num_seqs=8, max_model_len=128, device=device, graph_policy=GraphPolicy(compile=False))
    engine, tokenizer = LLMEngine.from_config(config)
    seqs = [engine.add_request(p, params) for p, params in batch]
    while engine.has_work():
        engine.step()
    return [(s.output_ids, s.finish_reason) for s in seqs], engine.stats.snapshot(), tokenizer


def test_a_mixed_batch_replays_its_graph_and_leaves_free_rows_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    free, _, _ = run("cuda", requests(False))
    mixed, stats, tokenizer = run("cuda", requests(True))
    on_cpu, _, _ = run("cpu", requests(True))
    for i, ((ids, reason), (free_ids, free_reason)) in enumerate(zip(mixed, free)):
        if i % 2:
            document = json.loads(tokenizer.decode(ids))
            assert set(document) == {"kind", "n"} and document["kind"] in ("cat", "dog") and 0 <= document["n"] <= 99
            assert reason == "stop"
        else:
            assert (ids, reason) == (free_ids, free_reason)
    assert mixed == on_cpu
    modes = {p["execution_mode"] for p in stats["decode_step_parts"]}
    assert modes == {"cuda_graph"}, stats["decode_step_parts"]
