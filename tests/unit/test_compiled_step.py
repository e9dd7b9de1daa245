"""The decode step compiled once for every bucket (CPU, inductor's C++ backend, a 2-layer fp32 model):
dynamo compiles one graph for a ladder of four buckets (size 1 included), every bucket is captured
(the CPU stand-in) and reported compiled, and greedy tokens through the padded compiled step equal
the plain eager model's at odd batch sizes."""

from __future__ import annotations

import pytest

import workers.serving.engine
from policies.graph_policy import GraphPolicy
from tests.unit.graph_faults import EagerGraphRunner
from workers.graphs.compile_cache import KEY_FILE
from workers.modeling.checkpoint import load_model
from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

BUCKETS = (1, 2, 4, 8)
MAX_MODEL_LEN = 64


class CompiledEagerGraphRunner(EagerGraphRunner):
    """The CPU stand-in for capture around the compiled step a CUDA device would capture."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.use_compiled_step()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tiny2") / "m", tiny_hf_config(300), build_byte_tokenizer(), seed=3)
    return load_model(path, MAX_MODEL_LEN)


def engine(model, compile: bool, **config) -> LLMEngine:
    policy = GraphPolicy(decode_batch_buckets=BUCKETS, compile=compile)
    return LLMEngine(
        model,
        EngineConfig(
            max_num_seqs=max(BUCKETS), max_model_len=MAX_MODEL_LEN, device="cpu", graph_policy=policy, **config
        ),
    )


def greedy(engine: LLMEngine) -> list[list[int]]:
    """Seven requests of different lengths and budgets: the running batch shrinks 7, 6, ..., 1 as
    they finish, so it pads into every bucket, from odd sizes too."""
    seqs = [
        engine.add_request([5 + i, 17, 42 + 3 * i][: 1 + i % 3], SamplingParams(max_tokens=4 + 3 * i, temperature=0.0))
        for i in range(7)
    ]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def test_one_compile_for_every_bucket_equals_eager(model, monkeypatch, tmp_path):
    monkeypatch.setattr(workers.serving.engine, "GraphRunner", CompiledEagerGraphRunner)
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # the engine sets them: put back after
        monkeypatch.delenv(variable, raising=False)
    compiled = engine(model, compile=True, compile_cache_dir=str(tmp_path))
    runner = compiled.runner
    assert runner.compiled and runner.graphs == 3  # start, layer, end: sizes 8, 4, 2 and 1 share each
    report = compiled.status().buckets
    assert all(report[f"decode_bs_{b}"]["ready"] and report[f"decode_bs_{b}"]["compiled"] for b in BUCKETS)
    assert compiled.status().startup["compiled_graphs"] == 3 and compiled.status().startup["phases"]["compile"] > 0
    (cache,) = tmp_path.iterdir()  # one subdirectory for this key, where inductor wrote its artifacts
    assert (cache / KEY_FILE).exists() and len(list(cache.iterdir())) > 1

    monkeypatch.undo()  # the reference: plain eager on the live rows (no graphs on the CPU)
    reference = engine(model, compile=False)
    assert not reference.runner.enabled
    out = greedy(compiled)
    assert sum(runner.replayed.values()) > 0 and set(runner.replayed) == set(BUCKETS)
    assert out == greedy(reference)
