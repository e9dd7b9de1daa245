"""CUDA-graph decode on the real GPU: replay must equal eager, for every bucket and between them."""

import pytest
import torch

from policies.dispatch import EngineState, FallbackReason
from policies.graph_policy import GraphPolicy
from workers.engine import EngineConfig, LLMEngine
from workers.graph_runner import GraphRunner
from workers.sampling import SamplingParams

pytestmark = pytest.mark.gpu

BUCKETS = (1, 2, 4, 8, 16, 32)
CAPTURE_ORDER = tuple(sorted(BUCKETS, reverse=True))
SIZES = (1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 33)  # every bucket, between buckets, and above the largest
STEPS = 64


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "models"))


def make_engine(mode="full", backend="sdpa", max_num_seqs=40, max_model_len=256, **policy):
    policy = GraphPolicy(mode=mode, decode_batch_buckets=policy.pop("buckets", BUCKETS), **policy)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, device="cuda",
                          attention_backend=backend, graph_policy=policy)  # fmt: skip
    return LLMEngine.from_config(config)[0]


def requests(n: int, seed: int, sampled: bool = True, max_tokens: int = STEPS):
    """n random prompts of different lengths; every other one sampled with its own seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(0, 256, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
        temp = 0.9 if sampled and i % 2 else 0.0
        out.append((prompt, SamplingParams(max_tokens=max_tokens, temperature=temp, top_p=0.95, seed=seed + i,
                                           ignore_eos=True)))  # fmt: skip
    return out


def run(engine: LLMEngine, reqs, denials=None):
    denials = denials or [None] * len(reqs)
    seqs = [engine.add_request(p, sp, graph_denial=d) for (p, sp), d in zip(reqs, denials)]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs], [s.slot for s in seqs]


@pytest.fixture(scope="module")
def eager_engine():
    return make_engine(mode="eager")


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_graph_equals_eager_every_size(mode, eager_engine):
    """For bucket and non-bucket batch sizes (and one above the largest bucket), 64 steps of greedy
    and seeded-sampled tokens from replay equal eager, and real rows' KV is identical."""
    engine = make_engine(mode)
    assert engine.state == EngineState.READY
    assert engine.runner.table.ready == set(BUCKETS)
    for n in SIZES:
        reqs = requests(n, seed=n)
        graph_out, slots = run(engine, reqs)
        eager_out, eager_slots = run(eager_engine, reqs)
        assert graph_out == eager_out, f"batch size {n}"
        assert slots == eager_slots
        for slot, (prompt, _) in zip(slots, reqs):
            length = len(prompt) + STEPS - 1
            torch.testing.assert_close(engine.cache.k[:, slot, :, :length], eager_engine.cache.k[:, slot, :, :length])
            torch.testing.assert_close(engine.cache.v[:, slot, :, :length], eager_engine.cache.v[:, slot, :, :length])
    parts = {
        (p["execution_mode"], p["bucket_id"], p["fallback_reason"])
        for p in engine.stats.snapshot()["decode_step_parts"]
    }
    expected_mode = "cuda_graph" if mode == "full" else "piecewise"
    assert (expected_mode, "decode_bs_32", "none") in parts
    assert (expected_mode, "decode_bs_4", "none") in parts  # n=3 padded to 4
    assert ("eager", "none", "shape_miss") in parts  # n=33


def test_padding_rows_touch_only_the_scratch_slot():
    """A padded replay (3 rows in bucket 4) leaves every other slot's KV exactly as it was."""
    engine = make_engine(buckets=(4,), max_num_seqs=8)
    engine.cache.k.normal_()
    engine.cache.v.normal_()
    before_k, before_v = engine.cache.k.clone(), engine.cache.v.clone()
    _, slots = run(engine, requests(3, seed=5, max_tokens=8))
    untouched = [s for s in range(engine.cache.num_slots) if s not in slots]
    assert torch.equal(engine.cache.k[:, untouched], before_k[:, untouched])
    assert torch.equal(engine.cache.v[:, untouched], before_v[:, untouched])
    assert not torch.equal(engine.cache.k[:, engine.cache.scratch_slot], before_k[:, engine.cache.scratch_slot])


def test_full_piecewise_eager_agree_and_backend_downgrade(eager_engine):
    """A backend that cannot be captured turns full into piecewise (reason backend_unsupported),
    and its tokens equal full graphs' and eager's."""
    reqs = requests(6, seed=77)
    full = run(make_engine("full"), reqs)[0]
    downgraded = make_engine("full", backend="sdpa_varlen")
    assert downgraded.runner.table.downgrade_reason == FallbackReason.BACKEND_UNSUPPORTED
    assert run(downgraded, reqs)[0] == full == run(eager_engine, reqs)[0]
    modes = {p["execution_mode"] for p in downgraded.stats.snapshot()["decode_step_parts"]}
    assert modes == {"piecewise"}


def test_injected_capture_failure_costs_only_that_bucket(monkeypatch, eager_engine):
    original = GraphRunner._capture_full

    def failing(self, bucket, pool):
        if bucket == 4:
            raise RuntimeError("injected capture failure")
        return original(self, bucket, pool)

    monkeypatch.setattr(GraphRunner, "_capture_full", failing)
    engine = make_engine()
    table = engine.runner.table
    assert table.ready == set(BUCKETS) - {4}
    assert table.missing[4][0] == FallbackReason.CAPTURE_ERROR
    assert "injected capture failure" in engine.runner.report()["decode_bs_4"]["error"]
    reqs = requests(3, seed=3)
    assert run(engine, reqs)[0] == run(eager_engine, reqs)[0]
    parts = {(p["execution_mode"], p["fallback_reason"]) for p in engine.stats.snapshot()["decode_step_parts"]}
    assert ("eager", "capture_error") in parts


def cumulative_capture_mb(engine: LLMEngine) -> list[float]:
    """Capture memory summed in capture order (largest bucket first): entry i covers the first i buckets."""
    sums = [0.0]
    for bucket in CAPTURE_ORDER:
        sums.append(sums[-1] + engine.runner.records[bucket].memory_mb)
    return sums


def test_memory_budget_evicts_exactly_what_does_not_fit():
    """Two runs without a limit measure what each capture takes (they differ by one-time costs and
    the allocator's 2 MB granularity; a long max_model_len makes the largest graph's attention
    buffers tens of MB, well above that). The budget goes in the middle of the widest gap both runs
    leave between the cumulative sums before and after one bucket: the buckets captured before it
    are ready, it is evicted, and each bucket is ready exactly when its own measured memory still
    fits what is left (after an eviction, smaller graphs reuse the evicted graph's memory in the
    shared pool, so only the limited run's own numbers tell for them)."""
    runs = [cumulative_capture_mb(make_engine(max_model_len=4096)) for _ in range(2)]
    gaps = []
    for i in range(len(CAPTURE_ORDER)):
        low = max(r[i] for r in runs)  # the most either run took for the buckets before this one
        high = min(r[i + 1] for r in runs)  # the least either took with this one too
        gaps.append((high - low, i, low, high))
    width, gap, low, high = max(gaps)
    assert width >= 8, f"no capture stands out from the measurement noise: {runs}"
    budget = (low + high) / 2
    runner = make_engine(max_model_len=4096, graph_memory_budget_mb=budget).runner
    ready, missing = runner.table.ready, runner.table.missing
    assert set(CAPTURE_ORDER[:gap]) <= ready and CAPTURE_ORDER[gap] not in ready
    used = 0.0
    for bucket in CAPTURE_ORDER:
        memory = runner.records[bucket].memory_mb
        if used + memory <= budget:
            assert bucket in ready, (bucket, memory, used, budget)
            used += memory
        else:
            assert missing[bucket][0] == FallbackReason.EVICTED, bucket
            assert "graph_memory_budget_mb" in missing[bucket][1]
    assert sum(runner.records[b].memory_mb for b in ready) <= budget


def test_max_cached_graphs_keeps_the_largest():
    """Capture is largest first, so a cap of two keeps 32 and 16; the rest are evicted, saying why."""
    table = make_engine(max_cached_graphs=2).runner.table
    assert table.ready == {16, 32}
    assert {b: r for b, (r, _) in table.missing.items()} == dict.fromkeys((1, 2, 4, 8), FallbackReason.EVICTED)
    assert all("max_cached_graphs=2" in detail for _, detail in table.missing.values())


def test_denied_requests_never_replay_and_do_not_drag_others(monkeypatch, eager_engine):
    """Rows of a tenant without graph permission are computed eager; the rest of the batch still
    replays. The static inputs seen at every replay never hold a denied request's slot."""
    engine = make_engine()
    replayed_slots = set()
    for bucket, replay in list(engine.runner._replays.items()):

        def spy(bucket=bucket, replay=replay):
            replayed_slots.update(engine.runner.inputs[2, :bucket].tolist())
            return replay()

        engine.runner._replays[bucket] = spy
    reqs = requests(6, seed=11)
    denials = [None, FallbackReason.TENANT_DISABLED, None, None, FallbackReason.TENANT_DISABLED, None]
    out, slots = run(engine, reqs, denials)
    assert out == run(eager_engine, reqs)[0]
    assert replayed_slots and not replayed_slots & {slots[1], slots[4]}
    parts = {
        (p["execution_mode"], p["bucket_id"], p["fallback_reason"])
        for p in engine.stats.snapshot()["decode_step_parts"]
    }
    assert ("cuda_graph", "decode_bs_4", "none") in parts
    assert ("eager", "none", "tenant_disabled") in parts


def test_compiled_step_replays_bit_exact_and_agrees_with_uncompiled(eager_engine):
    """compile: true captures the inductor-compiled step; replay equals the compiled step run
    without replay (checked bit for bit at startup), and greedy tokens equal the uncompiled fp32 model."""
    engine = make_engine(buckets=(1, 4), compile=True)
    assert engine.runner.table.ready == {1, 4}
    assert all(r.verify_max_abs_diff == 0.0 for r in engine.runner.records.values())
    reqs = requests(3, seed=21, sampled=False, max_tokens=32)
    assert run(engine, reqs)[0] == run(eager_engine, reqs)[0]


def test_compile_holds_past_dynamo_recompile_limit():
    """A compiled engine of 12 buckets: 12 shapes of one function, past dynamo's default limit of 8
    after which it used to run the step uncompiled without a word. Every shape must be compiled (a
    graph each) and every bucket still verify bit for bit."""
    from torch._dynamo.utils import counters

    buckets = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
    before = counters["stats"]["unique_graphs"]
    engine = make_engine(buckets=buckets, compile=True, max_num_seqs=16, max_cached_graphs=len(buckets))
    assert counters["stats"]["unique_graphs"] - before >= len(buckets)
    assert engine.runner.table.ready == set(buckets)
    assert all(r.verify_max_abs_diff == 0.0 for r in engine.runner.records.values())
