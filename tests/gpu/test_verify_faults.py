"""The verification gate on real CUDA graphs: a bucket captured through a faulty step (NaN logits at
the argmax, rows and slots mixed up, a stale length, a mask that sees one position more or less) is
withdrawn with verify_mismatch before READY, while the unfaulted bucket of the same runner stays
ready; verification leaves every page but the scratch page, and the block table, as they were, also
when run again with live sequences (and garbage in the free pages) in a small pool.

The fault is swapped in for `runner.model_runner.step_fn` during that bucket's capture only, so the graph holds
it while verification's eager step is the correct one.
"""

import json

import pytest
import torch

from policies.dispatch import EngineState, FallbackReason
from policies.graph_policy import GraphPolicy
from tests.unit.graph_faults import FAULTS
from workers.graphs.graph_runner import GraphRunner
from workers.kv.kv_cache import SCRATCH_PAGE
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.gpu

BUCKETS = (4, 8)
FAULTY = 8


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "models"))


def make_engine(mode: str = "full", buckets: tuple[int, ...] = BUCKETS, **config) -> LLMEngine:
    policy = GraphPolicy(mode=mode, decode_batch_buckets=buckets, compile=False)
    config = EngineConfig(max_num_seqs=16, max_model_len=256, device="cuda", graph_policy=policy, **config)
    return LLMEngine.from_config(config)[0]


def requests(n: int, seed: int, max_tokens: int = 16) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist(),
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        for _ in range(n)
    ]


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
        correct, self.model_runner.step_fn = self.model_runner.step_fn, FAULTS[fault](self.model)
        try:
            return original(self, bucket)
        finally:
            self.model_runner.step_fn = correct

    monkeypatch.setattr(GraphRunner, "_capture_bucket", capture_through_fault)
    engine = make_engine()
    runner = engine.runner
    assert engine.state == EngineState.READY
    assert runner.table.ready == {4}
    assert runner.table.missing[FAULTY][0] == FallbackReason.VERIFY_MISMATCH
    assert runner.records[FAULTY].verify_max_abs_diff != 0.0 and runner.records[4].verify_max_abs_diff == 0.0
    json.dumps(runner.report(), allow_nan=False)  # what /admin/status renders
    cache = engine.cache
    # Only warmup and the first-token warm-up prefills write KV before READY, and only to the scratch
    # page: every other page is still zero after the faulty graph's probe writes were put back, and
    # every block-table row points at the scratch page again.
    assert not cache.k[:, SCRATCH_PAGE + 1 :].any() and not cache.v[:, SCRATCH_PAGE + 1 :].any()
    assert not cache.block_table.any()
    small, large = requests(3, seed=1), requests(7, seed=2)  # padded to bucket 4 (replay), 8 (eager)
    assert run(engine, small) == run(eager_engine, small)
    assert run(engine, large) == run(eager_engine, large)
    parts = engine.stats.snapshot()["decode_step_parts"]
    parts = {(p["execution_mode"], p["bucket_id"], p["fallback_reason"]) for p in parts}
    assert parts == {("cuda_graph", "decode_bs_4", "none"), ("eager", "none", "verify_mismatch")}


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_verify_again_with_live_sequences_changes_nothing(mode, eager_engine):
    """Verifying mid-stream keeps every bucket and leaves every page but the scratch page bit for bit
    (the live sequences' and the free ones, filled with garbage) and the whole block table; the
    probe really did use live slots and pages (a pool of 24 pages, most of them held), and the
    live sequences' tokens still equal eager's."""
    engine = make_engine(mode, buckets=(1, 4, 8), kv_cache_tokens=24 * 16)
    cache, blocks = engine.cache, engine.scheduler.blocks
    reqs = requests(6, seed=3, max_tokens=24)
    seqs = [engine.add_request(p, sp) for p, sp in reqs]
    for _ in range(8):
        engine.step()
    live_slots = {s.slot for s in seqs if s.slot >= 0}
    held = {p for s in seqs if s.slot >= 0 for p in blocks.block_table(s.request_id)}
    assert len(live_slots) >= 4 and len(held) >= 8
    free = [p for p in range(SCRATCH_PAGE + 1, cache.num_pages) if p not in held]
    g = torch.Generator(device=cache.k.device).manual_seed(4)
    for pool in (cache.k, cache.v):
        pool[:, free] = torch.randn(pool[:, free].shape, generator=g, device=pool.device, dtype=pool.dtype)
    probes = [engine.runner.probe(b, b + 1) for b in (1, 4, 8)]  # what verify will use (seed = bucket + 1)
    assert live_slots & {s for p in probes for s in p.slots}
    assert held & {page for p in probes for page in p.pages[2::3]}
    real = slice(SCRATCH_PAGE + 1, None)
    live_k, live_v, table = cache.k[:, real].clone(), cache.v[:, real].clone(), cache.block_table.clone()
    engine.runner.verify()
    assert engine.runner.table.ready == {1, 4, 8}
    assert torch.equal(cache.k[:, real], live_k) and torch.equal(cache.v[:, real], live_v)
    assert torch.equal(cache.block_table, table)
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == run(eager_engine, reqs)
