"""Online shadow verification on CPU, through the runner's real decode path around the eager-backed
stand-in for graphs (`EagerGraphRunner`): every n-th replay is recomputed and must be bit-equal; a
replay that goes wrong after startup is caught within n replays, its bucket withdrawn
(verify_mismatch) with the numbers, the step answered with the eager logits, and the KV cache is
left as the step itself leaves it."""

from __future__ import annotations

import pytest
import torch

from policies.dispatch import ExecutionMode, FallbackReason
from policies.graph_policy import GraphPolicy
from tests.kv_pages import assign_pages
from tests.unit.engine_fixtures import Tiny, load_tiny
from tests.unit.graph_faults import EagerGraphRunner
from workers.model_runner.step_inputs import DecodeInputs

EVERY = 3


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def make_runner(tiny: Tiny, every: int = EVERY) -> EagerGraphRunner:
    policy = GraphPolicy(decode_batch_buckets=(1, 2, 4, 8), shadow_verify_every_n_steps=every)
    runner = EagerGraphRunner(tiny.model, tiny.model.make_kv_cache(8), policy)
    runner.prepare()
    assign_pages(runner.cache)
    return runner


BATCH = DecodeInputs([17, 230, 5], [5, 21, 40], [0, 3, 6], [0, 0, 0])  # 3 rows: bucket 4, a padding row


@torch.inference_mode()
def test_every_nth_replay_is_checked_and_a_correct_graph_passes(tiny):
    runner = make_runner(tiny)
    for _ in range(2 * EVERY):
        logits, dispatch = runner.decode(BATCH)
        assert dispatch.mode == ExecutionMode.CUDA_GRAPH and dispatch.bucket == 4
    report = runner.shadow.report()
    assert (report["checks"], report["mismatches"]) == (2, 0)
    assert report["by_bucket"] == [{"bucket_id": "decode_bs_4", "result": "match", "count": 2}]
    assert not make_runner(tiny, every=0).shadow.due()


@torch.inference_mode()
def test_a_check_leaves_the_cache_as_the_step_leaves_it(tiny):
    runner = make_runner(tiny)
    runner.decode(BATCH)  # unchecked: writes this step's K/V
    after_step = runner.cache.k.clone(), runner.cache.v.clone()
    runner.decode(BATCH)
    runner.decode(BATCH)  # checked: the replay and its recomputation write the same K/V again
    assert runner.shadow.report()["checks"] == 1
    assert torch.equal(runner.cache.k, after_step[0]) and torch.equal(runner.cache.v, after_step[1])


@torch.inference_mode()
def test_a_replay_gone_wrong_is_withdrawn_within_n_replays(tiny):
    runner = make_runner(tiny)
    runner.decode(BATCH)
    good = runner._replays[4]
    runner._replays[4] = lambda: good() + 1e-3  # the fault: a graph whose output drifted
    for _ in range(EVERY):
        logits, dispatch = runner.decode(BATCH)
        if 4 not in runner.table.ready:
            break
    assert 4 not in runner.table.ready and 4 not in runner._replays
    eager = runner.model_runner.step(4)[:3]  # the step on the inputs the replay read
    assert torch.equal(logits, eager)  # the checked step was answered with the right logits
    reason, detail = runner.table.missing[4]
    assert reason == FallbackReason.VERIFY_MISMATCH and "shadow verification" in detail and "0.001" in detail
    report = runner.shadow.report()
    assert (
        report["mismatches"] == 1 and "decode_bs_4" in report["last_mismatch"] and "3 rows" in report["last_mismatch"]
    )
    logits, dispatch = runner.decode(BATCH)
    assert (dispatch.mode, dispatch.reason) == (ExecutionMode.EAGER, FallbackReason.VERIFY_MISMATCH)
    assert runner.report()["decode_bs_4"]["fallback_reason"] == "verify_mismatch"
