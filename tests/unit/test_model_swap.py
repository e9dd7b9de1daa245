"""The rolling swap's stage machine and the controller's part (no Ray): one replica at a time (or
max_unavailable), progress from the replicas' real report payloads, a reverted replica fails the
swap and stops it, a silent replica times it out, a swap and a rollout exclude each other, and the
state survives a controller restart; what a starting replica loads follows the last success."""

from __future__ import annotations

import time

import pytest

from app.auth import Operator
from app.controller import GraphController
from policies.model_swap import Swap, SwapPhase, SwapRequest

PREVIOUS = {"model": "/ckpt/v1", "revision": "v1"}


def started(replicas=("r1", "r2", "r3"), **settings) -> Swap:
    request = SwapRequest(model="/ckpt/v2", revision="v2", **settings)
    return Swap.begin(
        "swap-1",
        "model",
        request,
        {"model": "/ckpt/v2", "revision": "v2"},
        PREVIOUS,
        list(replicas),
        "alice",
        now=100.0,
    )


def test_replicas_swap_in_turn_and_the_swap_succeeds():
    swap = started()
    assert swap.now_swapping() == ["r1"]
    for step in ("draining", "loading"):
        assert swap.record("r1", step, 101.0) is None
    assert swap.now_swapping() == ["r1"]
    swap.record("r1", "serving", 102.0, "gate ok", "in_place")
    assert swap.now_swapping() == ["r2"]
    swap.record("r2", "serving", 103.0)
    reason = swap.record("r3", "serving", 104.0)
    assert swap.phase == SwapPhase.SUCCEEDED and "3 replica" in reason and swap.now_swapping() == []
    assert [s["step"] for s in swap.replicas["r1"].steps] == ["draining", "loading", "serving"]
    assert swap.replicas["r1"].path == "in_place" and swap.replicas["r1"].finished_at == 102.0


def test_max_unavailable_swaps_several_at_once():
    swap = started(max_unavailable=2)
    assert swap.now_swapping() == ["r1", "r2"]
    swap.record("r2", "serving", 101.0)
    assert swap.now_swapping() == ["r1", "r3"]


def test_a_reverted_replica_fails_the_swap_and_no_other_starts():
    swap = started()
    swap.record("r1", "serving", 101.0)
    reason = swap.record("r2", "reverted", 102.0, "eager probe: 3 of 10 logits are not finite")
    assert swap.phase == SwapPhase.FAILED and "r2" in reason and "not finite" in reason
    assert swap.now_swapping() == [] and swap.replicas["r3"].step == "waiting"
    assert swap.record("r3", "draining", 103.0) is None  # a finished swap takes no more progress


def test_a_replica_that_never_finishes_times_the_swap_out():
    swap = started(replica_timeout_s=60)
    assert swap.check_timeouts(150.0) is None
    swap.record("r1", "serving", 150.0)
    assert swap.check_timeouts(200.0) is None  # r2 was told at 150
    assert "r2" in swap.check_timeouts(211.0) and swap.phase == SwapPhase.FAILED


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"model": ""},
        {"model": 3},
        {"model": "/ckpt\x00v2"},
        {"model": "/x", "max_unavailable": 0},
        {"model": "/x", "colour": "red"},
    ],
)
def test_bad_requests_are_refused_naming_the_field(tmp_path, body):
    c = GraphController(str(tmp_path / "state.json"), {})
    c.report("r1", {"state": "READY"})
    result = c.start_swap("model", body, PREVIOUS, Operator("alice"))
    assert result["status"] == 400 and c.swap is None


def replica_report(swap_id: str, step: str) -> dict:
    return {"state": "READY", "swap": {"id": swap_id, "step": step, "detail": None, "path": "rebuild", "at": 0}}


def test_the_controller_runs_a_swap_from_reports_and_persists_it(tmp_path):
    path = str(tmp_path / "state.json")
    c = GraphController(path, {})
    assert c.start_swap("model", {"model": "/ckpt/v2"}, PREVIOUS, Operator("alice"))["status"] == 409  # nobody READY
    for r in ("r1", "r2"):
        c.report(r, {"state": "READY"})
    swap = c.start_swap("model", {"model": "/ckpt/v2", "revision": "v2"}, PREVIOUS, Operator("alice"))["swap"]
    assert swap["id"] == "swap-1" and swap["order"] == ["r1", "r2"]
    assert c.start_swap("model", {"model": "/ckpt/v3"}, PREVIOUS, Operator("bob"))["status"] == 409
    assert c.start_rollout({"steps": [{"percent": 100}]}, Operator("bob"))["status"] == 409
    version = c.version
    c.report("r1", replica_report("swap-1", "draining"))
    c.report("r1", replica_report("swap-1", "serving"))
    assert c.version > version and c._swap_order()["now"] == ["r2"]

    restarted = GraphController(path, {})
    assert restarted.swap.replicas["r1"].step == "serving" and restarted._swap_order()["now"] == ["r2"]
    restarted.report("r2", replica_report("swap-1", "serving"))
    assert restarted.swap.phase == SwapPhase.SUCCEEDED
    assert restarted.serving_model == {"model": "/ckpt/v2", "revision": "v2"}  # what a starting replica loads
    entries = [a for a in restarted.audit if a["action"] == "swap"]
    assert entries[0]["actor"] == "alice" and entries[-1]["phase"] == "Succeeded"
    assert GraphController(path, {}).serving_model == {"model": "/ckpt/v2", "revision": "v2"}


def test_a_graph_policy_swap_keeps_the_model(tmp_path):
    c = GraphController(str(tmp_path / "state.json"), {})
    c.report("r1", {"state": "READY"})
    c.start_swap("model", {"model": "/ckpt/v2", "revision": "v2"}, PREVIOUS, Operator("alice"))
    c.report("r1", replica_report("swap-1", "serving"))
    c.start_swap("graph_policy", {"decode_batch_buckets": [1, 3]}, {"graph_policy": {}}, Operator("alice"))
    c.report("r1", replica_report("swap-2", "serving"))
    assert c.serving_model == {"model": "/ckpt/v2", "revision": "v2", "graph_policy": {"decode_batch_buckets": [1, 3]}}


def test_a_silent_replica_fails_the_swap_in_the_decision_loop(tmp_path):
    c = GraphController(str(tmp_path / "state.json"), {})
    c.report("r1", {"state": "READY"})
    c.start_swap("model", {"model": "/ckpt/v2", "replica_timeout_s": 5}, PREVIOUS, Operator("alice"))
    c.check_swap(now=time.time() + 1)
    assert c.swap.phase == SwapPhase.PROGRESSING
    c.check_swap(now=time.time() + 10)
    assert c.swap.phase == SwapPhase.FAILED and "within 5 s" in c.swap.reason


def test_a_replica_that_died_in_its_turn_leaves_the_swap_and_the_next_takes_its_turn(tmp_path):
    """A replica killed while draining kept its turn until replica_timeout_s (30 minutes): every
    swap, policy change and rollout was a 409 meanwhile. Silent past GONE_AFTER_S["draining"] in
    its turn, it leaves; a slow one that still reports keeps it."""
    from app.controller import GONE_AFTER_S

    SWAPPING_GONE_AFTER_S = GONE_AFTER_S["draining"]

    c = GraphController(str(tmp_path / "state.json"), {})
    for r in ("r1", "r2", "r3"):
        c.report(r, {"state": "READY"})
    c.start_swap("model", {"model": "/ckpt/v2"}, PREVIOUS, Operator("alice"))
    c.report("r1", replica_report("swap-1", "draining"))
    c.report("r2", {"state": "READY"})
    c.report("r3", {"state": "READY"})
    died = c.replicas["r1"]["reported_at"]
    for r in ("r2", "r3"):  # the others still report
        c.replicas[r]["reported_at"] = died + SWAPPING_GONE_AFTER_S
    c.check_swap(now=died + SWAPPING_GONE_AFTER_S - 1)
    assert c._swap_order()["now"] == ["r1"]
    c.check_swap(now=died + SWAPPING_GONE_AFTER_S + 1)
    assert c.swap.phase == SwapPhase.PROGRESSING and "r1" not in c.swap.order
    assert c._swap_order()["now"] == ["r2"]


def test_decisions_the_controller_makes_itself_do_not_wait_for_a_disk(tmp_path, monkeypatch):
    """With the state file unwritable, a swap's progress and a rollback still take effect (in
    memory, audited, one version more each), while an operator's start is refused."""
    import app.controller as controller

    c = GraphController(str(tmp_path / "state.json"), {})
    c.report("r1", {"state": "READY"})
    c.start_swap("model", {"model": "/ckpt/v2"}, PREVIOUS, Operator("alice"))

    def unwritable(path, state):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(controller, "_write_state", unwritable)
    version = c.version
    c.report("r1", replica_report("swap-1", "serving"))
    assert c.swap.phase == SwapPhase.SUCCEEDED and c.serving_model["model"] == "/ckpt/v2"
    assert c.version == version + 1 and c.audit[-1]["phase"] == "Succeeded"
    assert (
        c.start_rollout({"steps": [{"percent": 50, "hold_s": 60}, {"percent": 100}]}, Operator("bob"))["status"] == 409
    )


@pytest.mark.parametrize("field", ["drain_timeout_s", "replica_timeout_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_timeout_that_is_not_finite_is_refused(field, value):
    """JSON's 1e999 parses as inf: a swap took it, answered it as null and persisted Infinity."""
    with pytest.raises(ValueError, match="finite number"):
        SwapRequest(model="/ckpt/v2", **{field: value})
