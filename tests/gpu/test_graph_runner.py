"""CUDA-graph decode on the real GPU over the paged KV cache: replay must equal eager, for every
bucket and between them, with each attention backend; padding rows write only the scratch page.

`Trace`/`run` (also used by test_paged_decode.py) record, besides each request's tokens, what it
was streamed and every page it held: the scheduler is spied on right after it hands out pages
(admission, and the pages a decode step needs), so even a page taken by a sequence's last step and
freed by its finish is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from policies.dispatch import EngineState, FallbackReason
from policies.graph_policy import GraphPolicy
from workers.graphs.graph_runner import GraphRunner
from workers.kv.kv_cache import SCRATCH_PAGE
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.gpu

BUCKETS = (1, 2, 4, 8, 16, 32)
CAPTURE_ORDER = tuple(sorted(BUCKETS, reverse=True))
SIZES = (1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 33)  # every bucket, between buckets, and above the largest
STEPS = 64
ENGINE_OPTIONS = ("kv_page_size", "kv_cache_tokens", "max_num_batched_tokens")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "models"))


def make_engine(mode="full", backend="sdpa", max_num_seqs=40, max_model_len=256, **options) -> LLMEngine:
    """The default tiny model (fp32) on CUDA. `buckets=None` is the default ladder for max_num_seqs;
    kv_page_size / kv_cache_tokens / max_num_batched_tokens go to the engine, the rest to the policy."""
    engine_options = {k: options.pop(k) for k in ENGINE_OPTIONS if k in options}
    options.setdefault("compile", False)  # compile is the default; tests opt in where they need it
    policy = GraphPolicy(mode=mode, decode_batch_buckets=options.pop("buckets", BUCKETS), **options)
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        device="cuda",
        attention_backend=backend,
        graph_policy=policy,
        **engine_options,
    )
    engine = LLMEngine.from_config(config)[0]
    assert engine.model.attention_backend.name == backend
    return engine


def requests(n: int, seed: int, sampled: bool = True, max_tokens: int = STEPS, lengths: tuple[int, int] = (3, 40)):
    """n random prompts of different lengths; every other one sampled with its own seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(0, 256, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
        temp = 0.9 if sampled and i % 2 else 0.0
        out.append(
            (
                prompt,
                SamplingParams(max_tokens=max_tokens, temperature=temp, top_p=0.95, seed=seed + i, ignore_eos=True),
            )
        )
    return out


@dataclass
class Trace:
    """What one engine did with a set of requests, by request id."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    streamed: dict[str, list[int]] = field(default_factory=dict)
    tables: dict[str, list[int]] = field(default_factory=dict)  # the last block table each request held
    pages: dict[str, set[int]] = field(default_factory=dict)  # every page each request ever held
    slots: dict[str, set[int]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)  # in the order it happened (one entry per preemption)
    seqs: dict[str, object] = field(default_factory=dict)

    def outputs_of(self, ids) -> list[list[int]]:
        return [self.outputs[i] for i in ids]


def watch(engine: LLMEngine, trace: Trace) -> None:
    """Record every page and slot a request holds, right after the scheduler hands them out."""
    sched = engine.scheduler
    if getattr(sched, "_traced", None) is trace:
        return
    admit, reserve = type(sched).admit.__get__(sched), type(sched).reserve_decode.__get__(sched)

    def note(seqs) -> None:
        for seq in seqs:
            table = sched.blocks.block_table(seq.request_id)
            assert SCRATCH_PAGE not in table, f"{seq.request_id} holds the scratch page"
            trace.tables[seq.request_id] = table
            trace.pages.setdefault(seq.request_id, set()).update(table)
            trace.slots.setdefault(seq.request_id, set()).add(seq.slot)

    def admit_spy(*args, **kwargs):
        admitted = admit(*args, **kwargs)
        note(admitted)
        return admitted

    def reserve_spy(*args):
        preempted = reserve(*args)
        trace.preempted += [s.request_id for s in preempted]
        assert all(s.slot == -1 for s in preempted)
        note(sched.running.values())
        return preempted

    sched.admit, sched.reserve_decode, sched._traced = admit_spy, reserve_spy, trace


def add(engine: LLMEngine, trace: Trace, reqs, prefix: str = "r", denials=None) -> list[str]:
    watch(engine, trace)
    ids = []
    for i, ((prompt, params), denial) in enumerate(zip(reqs, denials or [None] * len(reqs))):
        seq = engine.add_request(prompt, params, request_id=f"{prefix}{i}", graph_denial=denial)
        trace.seqs[seq.request_id] = seq
        ids.append(seq.request_id)
    return ids


def step(engine: LLMEngine, trace: Trace) -> None:
    """One engine step; its events are checked (nothing after a request's last event) and kept."""
    for event in engine.step():
        assert event.request_id not in trace.finish, f"{event.request_id}: an event after its last one"
        assert event.error is None, event.error
        trace.streamed.setdefault(event.request_id, []).extend(event.token_ids)
        if event.finish_reason is not None:
            trace.finish[event.request_id] = event.finish_reason
    for rid, seq in trace.seqs.items():
        if seq.finish_reason is not None:
            trace.outputs[rid] = seq.output_ids
            trace.finish.setdefault(rid, seq.finish_reason)  # aborted: no event says so


def drain(engine: LLMEngine, trace: Trace) -> Trace:
    steps = 0
    while engine.has_work():
        step(engine, trace)
        steps += 1
        assert steps < 5000, "the engine does not finish"
    for rid, seq in trace.seqs.items():
        trace.outputs[rid] = seq.output_ids
        assert seq.slot == -1
    return trace


def run(engine: LLMEngine, reqs, denials=None, trace: Trace | None = None) -> Trace:
    """All requests added at once (ids r0, r1, ...) and stepped to completion."""
    trace = trace or Trace()
    add(engine, trace, reqs, denials=denials)
    return drain(engine, trace)


def check_streams(trace: Trace) -> None:
    """Each request was streamed exactly its output, once, in order."""
    for rid, seq in trace.seqs.items():
        assert trace.streamed.get(rid, []) == seq.output_ids, f"{rid}: streamed != output_ids"


def check_all_free(engine: LLMEngine) -> None:
    kv = engine.status().kv_cache
    assert kv.pages_free == kv.pages == engine.cache.num_pages - 1
    assert sorted(engine.scheduler.free_slots) == list(range(engine.cache.num_slots))
    assert not engine.cache.block_table[engine.cache.scratch_slot].any()


def decode_parts(engine: LLMEngine) -> set[tuple[str, str, str]]:
    return {
        (p["execution_mode"], p["bucket_id"], p["fallback_reason"])
        for p in engine.stats.snapshot()["decode_step_parts"]
    }


def assert_pools_close(a: LLMEngine, b: LLMEngine) -> None:
    """Every page but the scratch page holds the same K/V in both engines."""
    for x, y in ((a.cache.k, b.cache.k), (a.cache.v, b.cache.v)):
        assert x.shape == y.shape
        torch.testing.assert_close(x[:, 1:], y[:, 1:])


@pytest.fixture(scope="module")
def eager_engine():
    return make_engine(mode="eager")


GRAPH_CASES = [("full", "triton"), ("full", "sdpa"), ("piecewise", "triton"), ("piecewise", "sdpa")]


@pytest.mark.parametrize("mode, backend", GRAPH_CASES)
def test_graph_equals_eager_every_size(mode, backend):
    """For bucket and non-bucket batch sizes (and one above the largest bucket), 64 steps of greedy
    and seeded-sampled tokens from replay equal eager with the same backend; both engines (fresh,
    same config, so the scheduler hands out the same pages) hold the same block tables and the
    same K/V in every page but the scratch page, after each batch size."""
    engine = make_engine(mode, backend)
    eager = make_engine("eager", backend)
    assert engine.state == EngineState.READY
    assert engine.runner.table.ready == set(BUCKETS)
    assert_pools_close(engine, eager)  # both still all zero outside the scratch page
    assert not engine.cache.k[:, 1:].any()
    for n in SIZES:
        reqs = requests(n, seed=n)
        graph, reference = run(engine, reqs), run(eager, reqs)
        assert graph.outputs == reference.outputs, f"batch size {n}"
        assert graph.tables == reference.tables and graph.slots == reference.slots
        assert all(len(t) >= 2 for t in graph.tables.values())  # every sequence crossed a page boundary
        check_streams(graph)
        assert_pools_close(engine, eager)
        check_all_free(engine)
    parts = decode_parts(engine)
    expected_mode = "cuda_graph" if mode == "full" else "piecewise"
    assert (expected_mode, "decode_bs_32", "none") in parts
    assert (expected_mode, "decode_bs_4", "none") in parts  # n=3 padded to 4
    assert ("eager", "none", "shape_miss") in parts  # n=33
    assert {p for p in parts if p[0] == "eager"} == {("eager", "none", "shape_miss")}
    assert decode_parts(eager) == {("eager", "none", "disabled")}


@pytest.mark.parametrize("mode, backend", [("full", "triton"), ("full", "sdpa"), ("piecewise", "triton")])
def test_padding_rows_touch_only_the_scratch_page(mode, backend):
    """A padded replay (3 rows in bucket 4) leaves every page the batch's sequences never held (the
    scratch page aside), and every position of theirs past what they wrote, exactly as it was; the
    padding rows' writes land in the scratch page."""
    engine = make_engine(mode, backend, buckets=(4,), max_num_seqs=8)
    cache = engine.cache
    cache.k.normal_()
    cache.v.normal_()
    before = cache.k.clone(), cache.v.clone()
    trace = run(engine, requests(3, seed=5, max_tokens=20))
    assert decode_parts(engine) == {("cuda_graph" if mode == "full" else "piecewise", "decode_bs_4", "none")}
    held = set().union(*trace.pages.values())
    untouched = [p for p in range(cache.num_pages) if p not in held and p != SCRATCH_PAGE]
    assert len(untouched) == cache.num_pages - 1 - len(held) > 0
    for now, was in zip((cache.k, cache.v), before):
        assert torch.equal(now[:, untouched], was[:, untouched])
        assert not torch.equal(now[:, SCRATCH_PAGE], was[:, SCRATCH_PAGE])
        for rid, table in trace.tables.items():
            written = trace.seqs[rid].length - 1  # the last token drawn is never written
            assert len(table) == -(-written // cache.page_size)
            offset = written % cache.page_size
            if offset:
                assert torch.equal(now[:, table[-1], offset:], was[:, table[-1], offset:]), rid
            assert not torch.equal(now[:, table[0], 0], was[:, table[0], 0]), rid  # its own writes did land
    check_all_free(engine)


def test_full_piecewise_eager_agree_and_backend_downgrade(eager_engine):
    """A backend that cannot be captured turns full into piecewise (reason backend_unsupported),
    and its tokens equal full graphs' (triton and sdpa) and eager's."""
    reqs = requests(6, seed=77)
    full = run(make_engine("full", "triton"), reqs).outputs
    assert run(make_engine("full", "sdpa"), reqs).outputs == full
    downgraded = make_engine("full", backend="sdpa_varlen")
    assert downgraded.runner.table.downgrade_reason == FallbackReason.BACKEND_UNSUPPORTED
    assert run(downgraded, reqs).outputs == full == run(eager_engine, reqs).outputs
    parts = decode_parts(downgraded)
    assert {m for m, _, _ in parts} == {"piecewise"}
    assert ("piecewise", "decode_bs_8", "backend_unsupported") in parts


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
    assert run(engine, reqs).outputs == run(eager_engine, reqs).outputs
    parts = {(m, r) for m, _, r in decode_parts(engine)}
    assert ("eager", "capture_error") in parts


def cumulative_capture_mb(engine: LLMEngine) -> list[float]:
    """Capture memory summed in capture order (largest bucket first): entry i covers the first i buckets."""
    sums = [0.0]
    for bucket in CAPTURE_ORDER:
        sums.append(sums[-1] + engine.runner.records[bucket].memory_mb)
    return sums


def test_memory_budget_evicts_exactly_what_does_not_fit():
    """Two runs without a limit measure what each capture takes (they differ by one-time costs and
    the allocator's 2 MB granularity; the sdpa backend gathers each row's whole block table, so a
    long max_model_len makes the largest graph's attention buffers tens of MB, well above that).
    The budget goes in the middle of the widest gap both runs leave between the cumulative sums
    before and after one bucket: the buckets captured before it are ready, it is evicted, and each
    bucket is ready exactly when its own measured memory still fits what is left (after an
    eviction, smaller graphs reuse the evicted graph's memory in the shared pool, so only the
    limited run's own numbers tell for them)."""
    runs = [cumulative_capture_mb(make_engine(backend="sdpa", max_model_len=4096)) for _ in range(2)]
    gaps = []
    for i in range(len(CAPTURE_ORDER)):
        low = max(r[i] for r in runs)  # the most either run took for the buckets before this one
        high = min(r[i + 1] for r in runs)  # the least either took with this one too
        gaps.append((high - low, i, low, high))
    width, gap, low, high = max(gaps)
    assert width >= 8, f"no capture stands out from the measurement noise: {runs}"
    budget = (low + high) / 2
    engine = make_engine(backend="sdpa", max_model_len=4096, graph_memory_budget_mb=budget)
    runner = engine.runner
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
    memory = engine.status().memory_mb
    assert memory["graphs"] == pytest.approx(runner.graph_memory_mb()) and memory["graphs"] <= budget
    assert memory["kv_pool"] == pytest.approx(engine.cache.nbytes / (1 << 20)) and memory["weights"] > 0


def test_max_cached_graphs_keeps_the_largest():
    """Capture is largest first, so a cap of two keeps 32 and 16; the rest are evicted, saying why."""
    table = make_engine(max_cached_graphs=2).runner.table
    assert table.ready == {16, 32}
    assert {b: r for b, (r, _) in table.missing.items()} == dict.fromkeys((1, 2, 4, 8), FallbackReason.EVICTED)
    assert all("max_cached_graphs=2" in detail for _, detail in table.missing.values())


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_denied_requests_never_replay_and_do_not_drag_others(backend, eager_engine):
    """Rows of a request without graph permission (tenant_disabled, rollout_holdback) are computed
    eager; the rest of the batch still replays. The static inputs seen at every replay never hold a
    denied request's slot, and every token equals eager's."""
    engine = make_engine(backend=backend)
    replayed_slots = set()
    for bucket, replay in list(engine.runner._replays.items()):

        def spy(bucket=bucket, replay=replay):
            replayed_slots.update(engine.runner.model_runner.inputs[2, :bucket].tolist())
            return replay()

        engine.runner._replays[bucket] = spy
    reqs = requests(6, seed=11)
    tenant, holdback = FallbackReason.TENANT_DISABLED, FallbackReason.ROLLOUT_HOLDBACK
    denials = [None, tenant, None, holdback, tenant, None]
    trace = run(engine, reqs, denials)
    assert trace.outputs == run(eager_engine, reqs).outputs
    check_streams(trace)
    denied_slots = set().union(*(trace.slots[f"r{i}"] for i in (1, 3, 4)))
    allowed_slots = set().union(*(trace.slots[f"r{i}"] for i in (0, 2, 5)))
    assert replayed_slots and not replayed_slots & denied_slots
    assert allowed_slots <= replayed_slots
    parts = decode_parts(engine)
    assert ("cuda_graph", "decode_bs_4", "none") in parts  # three allowed rows, padded to 4
    assert ("eager", "none", "tenant_disabled") in parts and ("eager", "none", "rollout_holdback") in parts


def test_compiled_step_replays_bit_exact_and_agrees_with_uncompiled(eager_engine):
    """compile: true captures the inductor-compiled step (the triton kernel an opaque op in it);
    replay equals the compiled step run without replay (checked bit for bit at startup), and greedy
    tokens equal the uncompiled fp32 model's."""
    engine = make_engine(backend="triton", buckets=(1, 4), compile=True)
    assert engine.runner.table.ready == {1, 4}
    assert all(r.verify_max_abs_diff == 0.0 for r in engine.runner.records.values())
    reqs = requests(3, seed=21, sampled=False, max_tokens=32)
    assert run(engine, reqs).outputs == run(eager_engine, reqs).outputs


def test_compile_is_the_default_with_full_graphs(eager_engine):
    """The default policy compiles every bucket it captures (status says so per bucket) and its
    greedy tokens equal eager's; piecewise and eager policies do not compile."""
    config = EngineConfig(max_num_seqs=2, max_model_len=256, device="cuda")
    engine = LLMEngine.from_config(config)[0]
    report = engine.status().buckets
    assert set(report) == {"decode_bs_1", "decode_bs_2"} and all(b["ready"] and b["compiled"] for b in report.values())
    reqs = requests(2, seed=23, sampled=False, max_tokens=24)
    assert run(engine, reqs).outputs == run(eager_engine, reqs).outputs
    assert not GraphPolicy(mode="piecewise").compiles and not GraphPolicy(mode="eager").compiles
