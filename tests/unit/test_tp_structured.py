"""response_format at tensor_parallel_size 2 on CPU (gloo, two processes): rank 0 compiles the
schema and applies its masks; rank 1 only follows the model calls, and needs no grammar. While the
only request waits for its schema (here: a compile held up past the collective timeout), rank 0 keeps the
followers alive with heartbeats, and the constrained requests then decode what a one-rank engine on
the same checkpoint decodes."""

from __future__ import annotations

import time

import pytest
import torch

import workers.serving.grammar
from tests.unit.test_tp_startup import start_two_ranks
from workers.front.shard_worker import prepare_follower
from workers.modeling.default_model import default_model_dir
from workers.serving.engine import LLMEngine, load_for_engine
from workers.serving.engine_config import EngineConfig
from workers.serving.json_schema import canonical_schema
from workers.serving.sampling import SamplingParams
from workers.tensor_parallel.tp import Follower, StepChannel, init_tp_group

pytestmark = pytest.mark.timeout(120)
SCHEMA = canonical_schema({"type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 1, "maxItems": 3})
REQUESTS = [
    ([256, 5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0, json_schema=SCHEMA)),
    ([256, 40, 41], SamplingParams(max_tokens=40, temperature=1.0, seed=3, json_schema=SCHEMA)),
]
TIMEOUT_S = 3.0  # the collective timeout: every wait of a follower is bounded by it
COMPILE_DELAY_S = TIMEOUT_S + 1.0


def config(model: str) -> EngineConfig:
    return EngineConfig(model=model, max_num_seqs=4, max_model_len=64, device="cpu")


def decode(engine: LLMEngine, tokenizer) -> list[tuple[str, str]]:
    seqs = [engine.add_request(p, params) for p, params in REQUESTS]
    while engine.has_work():
        engine.step()
    return [(tokenizer.decode(s.output_ids), s.finish_reason) for s in seqs]


def _serve(rank: int, port: int, model_dir: str) -> dict:
    cpu = torch.device("cpu")
    tp = init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", cpu, timeout_s=TIMEOUT_S)
    model, tokenizer, eos, revision = load_for_engine(config(model_dir), cpu, tp)
    channel = StepChannel(tp, cpu)
    if rank == 1:
        Follower(channel, prepare_follower(model, config(model_dir))).follow()
        return {}
    compile_now = workers.serving.grammar.GrammarCompiler._compile

    def slow_compile(self, schema):
        time.sleep(COMPILE_DELAY_S)  # longer than the followers' collective timeout
        return compile_now(self, schema)

    workers.serving.grammar.GrammarCompiler._compile = slow_compile
    engine = LLMEngine(model, config(model_dir), eos, revision, channel=channel, tokenizer=tokenizer)
    out = decode(engine, tokenizer)
    engine.stop_followers()
    return {"decoded": out}


def test_rank_zero_constrains_and_the_follower_waits_for_its_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    model_dir = str(default_model_dir())
    results = start_two_ranks(model_dir, work=_serve)
    model, tokenizer, eos, revision = load_for_engine(config(model_dir), torch.device("cpu"))
    alone = decode(LLMEngine(model, config(model_dir), eos, revision, tokenizer=tokenizer), tokenizer)
    assert results[0]["decoded"] == alone
    assert all(text.startswith('["') and reason == "stop" for text, reason in alone), alone
