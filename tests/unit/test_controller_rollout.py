"""The controller's rollout (no Ray: GraphController is a plain class until controller_handle wraps
it): plans validated, one rollout at a time, decisions fed by the replicas' real report payloads,
operator actions audited by name, state persisted with the toggles and resumed after a restart, and
the decision loop running on its own."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from app.auth import Operator
from app.controller import GraphController, signals_from_statuses

INITIAL = {"tenant-a": True, "tenant-b": True}
GUARDS = {"interval_s": 0.05, "min_samples": 10, "failure_limit": 2, "max_tpot_ratio": 1.1}
PLAN = {
    "steps": [{"percent": 10, "hold_s": 0}, {"percent": 50, "hold_s": 3600}, {"percent": 100}],
    "unit": "request",
    "guards": GUARDS,
}


def replica_status(n: int, graph_step_s: float = 0.01, mismatches: int = 0, errors: int = 0) -> dict:
    """What a replica reports (the fields the rollout reads), after n units of traffic in each cohort."""
    cohort = lambda step_s, errs: {"rows": 100 * n, "fallback_rows": 0, "calls": {"8": [20 * n, step_s * 20 * n]}}  # noqa: E731
    return {
        "state": "READY",
        "stats": {
            "cohorts": {"graph": cohort(graph_step_s, errors), "holdback": cohort(0.01, 0)},
            "shadow": {
                "checks": n,
                "mismatches": mismatches,
                "last_mismatch": "decode_bs_8: max |diff| 2.5 over 3 rows" if mismatches else None,
            },
        },
        "requests": {
            "cohorts": {
                "graph": {"requests": 20 * n, "errors": errors * n},
                "holdback": {"requests": 20 * n, "errors": 0},
            }
        },
    }


def make(tmp_path) -> GraphController:
    return GraphController(str(tmp_path / "state.json"), INITIAL)


def test_signals_sum_the_replicas_reports():
    s = signals_from_statuses({"r1": replica_status(1), "r2": replica_status(2, graph_step_s=0.02)})
    assert s.graph.requests == 60 and s.graph.rows == 300 and s.holdback.requests == 60
    assert s.graph.step_s == {8: (60, pytest.approx(0.2 + 0.8))} and s.shadow_checks == 3


def test_plans_are_validated_and_one_rollout_runs_at_a_time(tmp_path):
    c = make(tmp_path)
    bad = c.start_rollout({**PLAN, "steps": [{"percent": 50, "hold_s": 1}, {"percent": 10}]}, Operator("alice"))
    assert bad["status"] == 400 and "steps" in bad["error"] and c.rollout is None
    assert c.start_rollout({**PLAN, "unit": "gpu"}, Operator("alice"))["status"] == 400
    busy = c.start_rollout({**PLAN, "guards": {**GUARDS, "interval_s": 1e-9}}, Operator("alice"))
    assert busy["status"] == 400 and "interval_s" in busy["error"]
    loose = c.start_rollout({**PLAN, "steps": [{"percent": "50", "hold_s": 1}, {"percent": 100}]}, Operator("alice"))
    assert loose["status"] == 400 and "percent" in loose["error"]
    assert c.decide_every_s() == 1.0
    first = c.start_rollout(PLAN, Operator("alice"))["rollout"]
    assert (first["id"], first["phase"], first["percent"]) == ("rollout-1", "Progressing", 10)
    again = c.start_rollout(PLAN, Operator("bob"))
    assert again["status"] == 409 and "rollout-1" in again["error"]
    assert c.decide_every_s() == GUARDS["interval_s"]
    assert c.rollout_action("abort", Operator("bob"))["rollout"]["phase"] == "Aborted"
    assert c.decide_every_s() == 1.0  # a finished rollout's interval no longer paces the loop
    assert c.start_rollout(PLAN, Operator("bob"))["rollout"]["id"] == "rollout-2"  # a finished one can be replaced


def test_reports_drive_the_stages_and_a_mismatch_rolls_back(tmp_path):
    c = make(tmp_path)
    c.report("r1", replica_status(1))
    c.start_rollout(PLAN, Operator("alice"))
    version = c.version
    c.report("r1", replica_status(2))
    c.evaluate_rollout(now=time.time())
    assert c.rollout.step == 1 and c.rollout.percent == 50 and c.version > version  # replicas will see it
    c.report("r1", replica_status(3))
    c.evaluate_rollout(now=time.time())
    assert c.rollout.step == 1  # 50% holds for an hour
    assert all(g.verdict == "pass" for g in c.rollout.results)
    c.report("r1", replica_status(4, mismatches=1))  # acted on as it arrives, before the next interval
    current = c.current_rollout()
    assert current["phase"] == "RolledBack" and current["percent"] == 0 and "decode_bs_8" in current["reason"]
    assert c._cohort_rule()["percent"] == 0
    rollback = c.audit[-1]
    assert rollback["action"] == "rollout" and rollback["actor"] == "controller" and "mismatch" in rollback["reason"]


def test_only_a_new_mismatch_is_acted_on_at_arrival(tmp_path):
    """Reports without a new mismatch change nothing between intervals: the other guards count
    failed evaluations, and evaluating at every report would spend failure_limit in a moment."""
    c = make(tmp_path)
    c.report("r1", replica_status(1, graph_step_s=0.02, mismatches=1))  # an old mismatch, before the rollout
    c.start_rollout(PLAN, Operator("alice"))
    for n in (2, 3, 4):
        c.report("r1", replica_status(n, graph_step_s=0.02, mismatches=1))
    assert c.rollout.phase.value == "Progressing" and c.rollout.guard_failures == {}


def test_a_slow_graph_cohort_rolls_back_after_the_failure_limit(tmp_path):
    c = make(tmp_path)
    c.start_rollout(PLAN, Operator("alice"))
    for n in (1, 2):
        c.report("r1", replica_status(n, graph_step_s=0.02))
        c.evaluate_rollout(now=time.time())
    current = c.current_rollout()
    assert current["phase"] == "RolledBack" and current["guard_failures"] == {"tpot": 2}
    tpot = next(g for g in current["guards"] if g["guard"] == "tpot")
    assert tpot["verdict"] == "fail" and tpot["value"] == pytest.approx(2.0) and tpot["limit"] == 1.1


def test_operator_actions_are_audited_by_name_and_conflicts_refused(tmp_path):
    c = make(tmp_path)
    assert c.rollout_action("pause", Operator("alice"))["status"] == 404
    c.start_rollout(PLAN, Operator("alice"))
    assert c.rollout_action("pause", Operator("bob"))["rollout"]["phase"] == "Paused"
    refused = c.rollout_action("pause", Operator("bob"))
    assert refused["status"] == 409 and "Paused" in refused["error"]
    assert c.rollout_action("resume", Operator("carol"))["rollout"]["phase"] == "Progressing"
    assert c.rollout_action("promote", Operator("dave"))["rollout"]["percent"] == 50
    assert c.rollout_action("abort", Operator("erin"))["rollout"]["percent"] == 0
    assert [(a["actor"], a["reason"]) for a in c.audit][-4:] == [
        ("bob", "paused"),
        ("carol", "resumed"),
        ("dave", "step 1 at 50%: promoted"),
        ("erin", "aborted"),
    ]


def test_the_rollout_survives_a_controller_restart(tmp_path):
    first = make(tmp_path)
    first.set_toggle("tenant-b", False, Operator("alice"))
    first.start_rollout(PLAN, Operator("alice"))
    first.report("r1", replica_status(1))
    first.evaluate_rollout(now=time.time())
    second = make(tmp_path)
    assert second.current_rollout() == first.current_rollout() and second.toggles == first.toggles
    assert second.version == first.version and second.rollouts_started == 1
    assert json.loads((tmp_path / "state.json").read_text())["rollout"]["id"] == "rollout-1"


def test_a_state_file_with_a_shorter_interval_than_allowed_now_still_loads(tmp_path):
    """An older version took any interval_s > 0: its state (toggles, the rollout) loads, and the
    decision loop runs no faster than MIN_INTERVAL_S."""
    first = make(tmp_path)
    first.set_toggle("tenant-b", False, Operator("alice"))
    first.start_rollout(PLAN, Operator("alice"))
    state = json.loads((tmp_path / "state.json").read_text())
    state["rollout"]["plan"]["guards"]["interval_s"] = 1e-9
    (tmp_path / "state.json").write_text(json.dumps(state))
    second = make(tmp_path)
    assert second.toggles == first.toggles and second.rollout.plan.guards.interval_s == 1e-9
    assert second.decide_every_s() == 0.05


def test_a_start_that_cannot_be_written_changes_nothing(tmp_path):
    c = make(tmp_path)
    (tmp_path / "state.json").mkdir()  # the state file's path is a directory: every write fails
    result = c.start_rollout(PLAN, Operator("alice"))
    assert result["status"] == 409 and "not started" in result["error"]
    assert c.rollout is None and c.audit == [] and c.version == 0


def test_the_decision_loop_runs_on_its_own(tmp_path):
    async def scenario() -> str:
        c = make(tmp_path)
        c.report("r1", replica_status(1))
        version, permissions = await c.get_permissions()
        assert permissions == {"toggles": INITIAL, "rollout": None, "swap": None, "serving_model": None}
        c.start_rollout(PLAN, Operator("alice"))
        assert (await c.get_permissions(version))[1]["rollout"] == {"unit": "request", "percent": 10.0, "salt": ""}
        c.report("r1", replica_status(2))
        deadline = time.monotonic() + 5
        while c.rollout.step == 0:
            assert time.monotonic() < deadline, "the loop did not advance the rollout"
            await asyncio.sleep(0.01)
        return c.rollout.history[-1].actor

    assert asyncio.run(scenario()) == "controller"


def test_a_rollout_started_while_the_loop_waits_out_a_long_interval_is_evaluated_at_its_own(tmp_path):
    """A rollout of interval_s 600 is aborted while the loop sleeps; the next, of 0.05 s, is
    evaluated at its own pace (the loop used to sleep out the 600 s first)."""

    async def scenario() -> None:
        c = make(tmp_path)
        c.report("r1", replica_status(1))
        await c.get_permissions()  # starts the loop
        c.start_rollout({**PLAN, "guards": {**GUARDS, "interval_s": 600}}, Operator("alice"))
        await asyncio.sleep(0.2)  # the loop is asleep under the long interval now
        c.rollout_action("abort", Operator("alice"))
        c.start_rollout(PLAN, Operator("alice"))
        c.report("r1", replica_status(2))
        deadline = time.monotonic() + 5
        while c.rollout.step == 0:
            assert time.monotonic() < deadline, "the new rollout was not evaluated"
            await asyncio.sleep(0.01)

    asyncio.run(scenario())


def test_a_plan_is_bounded_in_what_it_may_ask(tmp_path):
    """A plan is persisted and echoed by every status call: its interval, holds, steps and salt are bounded."""
    c = make(tmp_path)
    for plan, field in (
        ({**PLAN, "guards": {**GUARDS, "interval_s": 1e308}}, "interval_s"),
        ({**PLAN, "steps": [{"percent": 10, "hold_s": 1e308}, {"percent": 100}]}, "hold_s"),
        ({**PLAN, "steps": [{"percent": 10, "hold_s": 1}] * 101 + [{"percent": 100}]}, "steps"),
        ({**PLAN, "salt": "s" * 257}, "salt"),
    ):
        refused = c.start_rollout(plan, Operator("alice"))
        assert refused["status"] == 400 and field in refused["error"] and c.rollout is None
