"""The verification gate on CPU: replays that are wrong (NaN, rows and slots mixed up, a stale length,
a wrong mask) are withdrawn with verify_mismatch while correct buckets stay ready; the probe rows
differ in slot, position and length; verification leaves the KV cache as it was; and the status
report stays JSON-safe when a replay's logits are not finite.

Replays come from `EagerGraphRunner` (real capture bookkeeping, verify and dispatch around an
eager-backed stand-in for graphs), so this runs without CUDA; tests/gpu/test_verify_faults.py
captures the same faults as real CUDA graphs.
"""

from __future__ import annotations

import json

import pytest
import torch

from policies.dispatch import Dispatch, ExecutionMode, FallbackReason
from policies.graph_policy import GraphPolicy
from tests.kv_pages import assign_pages
from tests.unit.engine_fixtures import Tiny, load_tiny
from tests.unit.graph_faults import FAULTS, EagerGraphRunner, Step
from workers.graphs.graph_runner import PROBE_PAGES, GraphRunner

pytestmark = pytest.mark.timeout(60)
BUCKETS = (1, 2, 4, 8)
SLOTS = 8


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def runner_for(tiny: Tiny, faults: dict[int, Step], buckets=BUCKETS, slots: int = SLOTS) -> EagerGraphRunner:
    runner = EagerGraphRunner(
        tiny.model, tiny.model.make_kv_cache(slots), GraphPolicy(decode_batch_buckets=buckets), faults
    )
    runner.prepare()
    return runner


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_wrong_replay_is_withdrawn_and_the_others_stay(tiny, fault):
    """The faulty bucket runs eager with verify_mismatch (its replay dropped); the others replay."""
    runner = runner_for(tiny, {4: FAULTS[fault](tiny.model)})
    assert runner.table.ready == {1, 2, 8}
    reason, detail = runner.table.missing[4]
    assert reason == FallbackReason.VERIFY_MISMATCH and detail
    assert 4 not in runner._replays
    assert runner.table.dispatch(3) == Dispatch(ExecutionMode.EAGER, None, FallbackReason.VERIFY_MISMATCH)
    assert runner.table.dispatch(5) == Dispatch(ExecutionMode.CUDA_GRAPH, 8, None)
    assert all(runner.records[b].verify_max_abs_diff == 0.0 for b in (1, 2, 8))


def test_correct_replays_all_pass(tiny):
    runner = runner_for(tiny, {})
    assert runner.table.ready == set(BUCKETS) and not runner.table.missing
    assert all(runner.replayed[b] == 1 for b in BUCKETS)  # verification replayed each bucket once


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_replay_fails_and_the_report_stays_json_safe(tiny, bad):
    """A non-finite logit at the argmax keeps the argmax, yet fails; /admin/status renders the report
    with allow_nan=False, so the diff is null and the error says non-finite."""
    model = tiny.model

    def poisoned(tokens, positions, slots, cache, adapters=None):
        logits = model.decode(tokens, positions, slots, cache)
        return logits.scatter(-1, logits.argmax(-1, keepdim=True), bad)

    runner = runner_for(tiny, {2: poisoned})
    assert runner.table.missing[2][0] == FallbackReason.VERIFY_MISMATCH
    report = runner.report()
    json.dumps(report, allow_nan=False)
    assert report["decode_bs_2"]["verify_max_abs_diff"] is None
    assert "non-finite" in report["decode_bs_2"]["error"]
    assert report["decode_bs_4"]["verify_max_abs_diff"] == 0.0 and report["decode_bs_4"]["ready"]


def test_probe_rows_differ_in_slot_position_and_length(tiny):
    """Real slots in shuffled order, distinct positions 1..n; rows beyond num_slots reuse slots at
    other positions; each probe slot gets scattered pages of its own; at large buckets positions
    repeat within PROBE_PAGES pages of context; rows beyond max_model_len - 2 are padding rows."""
    runner = GraphRunner(tiny.model, tiny.model.make_kv_cache(3), GraphPolicy())
    cache = runner.cache
    scratch, max_len, page = cache.scratch_slot, cache.max_model_len, cache.page_size

    tokens, positions, slots, _, pages = runner.probe(3, seed=1)
    assert sorted(slots) == [0, 1, 2] and sorted(positions) == [1, 2, 3]
    assert len(tokens) == 3

    _, positions, slots, _, pages = runner.probe(8, seed=2)
    assert set(slots) == {0, 1, 2} and sorted(positions) == list(range(1, 9))
    assert len(set(zip(slots, positions))) == 8
    triples = list(zip(pages[::3], pages[1::3], pages[2::3]))
    assert sorted((s, i) for s, i, _ in triples) == [(s, i) for s in range(3) for i in range(1)]  # 10 positions: 1 page
    assert len({p for _, _, p in triples}) == 3 and 0 not in {p for _, _, p in triples}

    bucket = max_len + 6
    tokens, positions, slots, _, pages = runner.probe(bucket, seed=3)
    real = max_len - 2
    span = PROBE_PAGES * page
    assert set(positions[:real]) == set(range(1, span - 1)) and scratch not in slots[:real]
    assert tokens[real:] == positions[real:] == [0] * 8 and slots[real:] == [scratch] * 8
    held = pages[2::3]
    assert len(held) == 3 * PROBE_PAGES and len(set(held)) == len(held) and 0 not in held
    assert sorted(held) != held  # scattered, not handed out in order

    assert runner.probe(8, seed=2) == runner.probe(8, seed=2)  # the same on every rank
    assert runner.probe(8, seed=2) != runner.probe(8, seed=5)


def test_probe_fits_a_small_pool(tiny):
    """With too few pages for a row per slot at the probe's span, the probe has fewer real rows (the
    rest pad), and never hands out a page twice."""
    cache = tiny.model.make_kv_cache(8, num_pages=1 + 6)
    runner = GraphRunner(tiny.model, cache, GraphPolicy())
    _, positions, slots, _, pages = runner.probe(8, seed=1)
    real = [s for s in slots if s != cache.scratch_slot]
    assert 0 < len(real) < 8 and len(pages[2::3]) == len(set(pages[2::3])) <= 6
    per_slot = len(pages) // 3 // len(set(real))
    assert max(positions[: len(real)]) + 2 <= per_slot * cache.page_size


def test_verification_leaves_the_kv_cache_as_it_was(tiny):
    """With live K/V in every page, verifying (faulty graphs included, which write where they should
    not) restores every real page and every block-table row exactly, and verifying again gives the
    same verdicts."""
    model = tiny.model
    runner = EagerGraphRunner(
        model,
        model.make_kv_cache(SLOTS),
        GraphPolicy(decode_batch_buckets=BUCKETS),
        {2: FAULTS["stale_length"](model), 4: FAULTS["slots_rolled"](model), 8: FAULTS["mask_one_more"](model)},
    )
    cache = runner.cache
    assign_pages(cache)
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    real = slice(1, None)  # every page but the scratch page
    live_k, live_v, table = cache.k[:, real].clone(), cache.v[:, real].clone(), cache.block_table.clone()

    def unchanged() -> bool:
        return (
            torch.equal(cache.k[:, real], live_k)
            and torch.equal(cache.v[:, real], live_v)
            and torch.equal(cache.block_table, table)
        )

    runner.prepare()
    assert runner.table.ready == {1}
    assert unchanged()
    runner.verify()
    assert runner.table.ready == {1} and runner.records[1].verify_max_abs_diff == 0.0
    assert unchanged()
