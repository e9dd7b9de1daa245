"""Online shadow verification with real CUDA graphs: replays of correct graphs match their eager
recomputation bit for bit under live traffic (triton and sdpa, plain and compiled), and a captured
bucket whose replay is perturbed after startup is withdrawn within n replays while every request
still gets the tokens eager decoding gives."""

from __future__ import annotations

import pytest
import torch

from policies.dispatch import FallbackReason
from tests.gpu.test_graph_runner import make_engine, requests, run

pytestmark = pytest.mark.gpu
EVERY = 4


@pytest.mark.parametrize("backend, compile", [("triton", False), ("sdpa", False), ("triton", True)])
def test_live_replays_match_their_recomputation(backend, compile):
    engine = make_engine(
        backend=backend, compile=compile, buckets=(1, 2, 4, 8), max_num_seqs=8, shadow_verify_every_n_steps=EVERY
    )
    run(engine, requests(7, seed=31, max_tokens=40))
    report = engine.status().stats["shadow"]
    assert report["checks"] == 39 // EVERY and report["mismatches"] == 0  # 39 decode steps after the prefill
    assert engine.runner.table.ready == {1, 2, 4, 8}


def test_a_perturbed_graph_is_withdrawn_at_the_first_check():
    """The fault bites (replays before the check pick the boosted tokens), the first check catches
    it, and from then on the bucket runs eager with verify_mismatch."""
    engine = make_engine(backend="triton", buckets=(4,), max_num_seqs=4, shadow_verify_every_n_steps=EVERY)
    graph = engine.runner._replays[4]

    def perturbed() -> torch.Tensor:
        out = graph()
        out[:, :8] += 1e4  # the fault: a replay whose first logits drift (and win the argmax)
        return out

    engine.runner._replays[4] = perturbed
    trace = run(engine, requests(3, seed=32, sampled=False, max_tokens=40))
    reason, detail = engine.runner.table.missing[4]
    assert reason == FallbackReason.VERIFY_MISMATCH and "shadow verification" in detail and "decode_bs_4" in detail
    report = engine.status().stats["shadow"]
    assert report["mismatches"] == 1 and report["checks"] == 1  # caught at the first check
    steps = {
        (p["execution_mode"], p["fallback_reason"]): p["steps"] for p in engine.stats.snapshot()["decode_step_parts"]
    }
    assert steps[("cuda_graph", "none")] == EVERY and steps[("eager", "verify_mismatch")] > 0
    for output in trace.outputs.values():
        assert all(t < 8 for t in output[1:EVERY])  # the replays before the check served the fault
        assert any(t >= 8 for t in output[EVERY:])  # the checked step and the eager ones did not
