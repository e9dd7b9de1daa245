"""The verification gate on real CUDA graphs: a bucket captured through a faulty step (NaN logits at
the argmax, rows and slots mixed up, a stale length, a mask that sees one position more or less) is
withdrawn with verify_mismatch before READY, while the unfaulted bucket of the same runner stays
ready; verification leaves every real slot's KV as it was, also when run again with live sequences.

The fault is swapped in for `runner.step_fn` during that bucket's capture only, so the graph holds
it while verification's eager step is the correct one.
"""

import json

import pytest
import torch

from policies.dispatch import EngineState, FallbackReason
from policies.graph_policy import GraphPolicy
from tests.unit.graph_faults import FAULTS
from workers.engine import EngineConfig, LLMEngine
from workers.graph_runner import GraphRunner
from workers.sampling import SamplingParams

pytestmark = pytest.mark.gpu

BUCKETS = (4, 8)
FAULTY = 8


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "models"))


def make_engine(mode: str = "full", buckets: tuple[int, ...] = BUCKETS) -> LLMEngine:
    config = EngineConfig(max_num_seqs=16, max_model_len=256, device="cuda",
                          graph_policy=GraphPolicy(mode=mode, decode_batch_buckets=buckets))  # fmt: skip
    return LLMEngine.from_config(config)[0]


def requests(n: int, seed: int, max_tokens: int = 16) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist(),
         SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        for _ in range(n)
    ]  # fmt: skip


def run(engine: LLMEngine, reqs) -> list[list[int]]:
    seqs = [engine.add_request(p, sp) for p, sp in reqs]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def eager_engine():
    return make_engine(mode="eager")


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_faulty_graph_is_withdrawn_before_ready(fault, monkeypatch, eager_engine):
    original = GraphRunner._capture_bucket

    def capture_through_fault(self, bucket):
        if bucket != FAULTY:
            return original(self, bucket)
        correct, self.step_fn = self.step_fn, FAULTS[fault](self.model)
        try:
            return original(self, bucket)
        finally:
            self.step_fn = correct

    monkeypatch.setattr(GraphRunner, "_capture_bucket", capture_through_fault)
    engine = make_engine()
    runner = engine.runner
    assert engine.state == EngineState.READY
    assert runner.table.ready == {4}
    assert runner.table.missing[FAULTY][0] == FallbackReason.VERIFY_MISMATCH
    assert runner.records[FAULTY].verify_max_abs_diff != 0.0 and runner.records[4].verify_max_abs_diff == 0.0
    json.dumps(runner.report(), allow_nan=False)  # what /admin/status renders
    scratch = engine.cache.scratch_slot
    # Only warmup and the first-token warm-up prefills write KV before READY, and only to the scratch
    # slot: every real slot is still zero after the faulty graph's probe writes were put back.
    assert not engine.cache.k[:, :scratch].any() and not engine.cache.v[:, :scratch].any()
    small, large = requests(3, seed=1), requests(7, seed=2)  # padded to bucket 4 (replay), 8 (eager)
    assert run(engine, small) == run(eager_engine, small)
    assert run(engine, large) == run(eager_engine, large)
    parts = engine.stats.snapshot()["decode_step_parts"]
    parts = {(p["execution_mode"], p["bucket_id"], p["fallback_reason"]) for p in parts}
    assert parts == {("cuda_graph", "decode_bs_4", "none"), ("eager", "none", "verify_mismatch")}


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_verify_again_with_live_sequences_changes_nothing(mode, eager_engine):
    """Verifying mid-stream keeps every bucket, leaves the live sequences' KV bit for bit, and their
    tokens still equal eager's."""
    engine = make_engine(mode, buckets=(1, 4, 8))
    reqs = requests(6, seed=3, max_tokens=24)
    seqs = [engine.add_request(p, sp) for p, sp in reqs]
    for _ in range(8):
        engine.step()
    real = slice(0, engine.cache.scratch_slot)
    live_k, live_v = engine.cache.k[:, real].clone(), engine.cache.v[:, real].clone()
    engine.runner.verify()
    assert engine.runner.table.ready == {1, 4, 8}
    assert torch.equal(engine.cache.k[:, real], live_k) and torch.equal(engine.cache.v[:, real], live_v)
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == run(eager_engine, reqs)
