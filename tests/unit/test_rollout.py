"""The rollout policy on its own: plan validation, sticky cohorts, guards and the stage machine."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from policies.dispatch import FallbackReason
from policies.rollout import (
    BUCKETS,
    CohortSignals,
    Guards,
    Phase,
    Rollout,
    RolloutConflict,
    RolloutPlan,
    Signals,
    cohort_bucket,
    evaluate_guards,
    graph_denial,
    in_cohort,
)

PLAN = {"steps": [{"percent": 5, "hold_s": 300}, {"percent": 25, "hold_s": 600}, {"percent": 100}], "unit": "tenant"}
GUARDS = Guards(min_samples=10, failure_limit=2)


def plan(**changes) -> RolloutPlan:
    return RolloutPlan.model_validate({**PLAN, "guards": GUARDS.model_dump(), **changes})


def healthy(n: int = 1, tpot_ratio: float = 1.0, errors: int = 0, fallback: int = 0) -> Signals:
    """n units of traffic, graphs and holdback alike (graph steps tpot_ratio as long)."""
    return Signals(
        graph=CohortSignals(
            requests=20 * n,
            errors=errors * n,
            rows=100 * n,
            fallback_rows=fallback * n,
            step_s={8: (20 * n, 0.1 * tpot_ratio * n)},
        ),
        holdback=CohortSignals(requests=20 * n, rows=100 * n, step_s={8: (20 * n, 0.1 * n)}),
        shadow_checks=n,
    )


# ---------------------------------------------------------------- plan


@pytest.mark.parametrize(
    "change, field",
    [
        ({"steps": []}, "steps"),
        ({"steps": [{"percent": 50, "hold_s": 1}, {"percent": 20}]}, "steps"),
        ({"steps": [{"percent": 5}, {"percent": 100}]}, "hold_s"),
        ({"steps": [{"percent": 101}]}, "percent"),
        ({"unit": "replica"}, "unit"),
        ({"guards": {"max_tpot_ratio": 0}}, "max_tpot_ratio"),
        ({"guards": {"min_sample": 3}}, "min_sample"),
        ({"speed": "fast"}, "speed"),
    ],
)
def test_invalid_plans_name_the_field(change, field):
    with pytest.raises(ValidationError) as exc:
        RolloutPlan.model_validate({**PLAN, **change})
    assert any(field in str(e["loc"]) or field in e["msg"] for e in exc.value.errors()), exc.value.errors()


def test_the_last_step_may_omit_its_hold():
    assert RolloutPlan.model_validate(PLAN).steps[-1].hold_s is None


# ---------------------------------------------------------------- cohorts


def test_cohort_hash_is_stable_across_processes():
    """A fixed value: sha256-based, not Python's per-process hash(), so every replica agrees."""
    assert cohort_bucket("", "tenant-a") == cohort_bucket("", "tenant-a") == 1006
    assert cohort_bucket("s1", "tenant-a") != cohort_bucket("s2", "tenant-a")


def test_raising_the_percentage_only_adds_keys():
    keys = [f"req-{i}" for i in range(3000)]
    previous: set[str] = set()
    for percent in (0, 1, 5, 25, 50, 99.99, 100):
        members = {k for k in keys if in_cohort(k, percent, "salt")}
        assert previous <= members
        previous = members
    assert previous == set(keys) and not {k for k in keys if in_cohort(k, 0, "salt")}


def test_cohorts_are_about_uniform():
    rng = random.Random(0)
    keys = [str(rng.getrandbits(64)) for _ in range(20000)]
    share = sum(in_cohort(k, 30) for k in keys) / len(keys)
    assert abs(share - 0.30) < 0.015
    counts = [0] * 10
    for k in keys:
        counts[cohort_bucket("", k) * 10 // BUCKETS] += 1
    assert max(counts) / min(counts) < 1.1


# ---------------------------------------------------------------- guards


def test_guards_pass_fail_and_inconclusive_with_their_numbers():
    results = {r.guard: r for r in evaluate_guards(GUARDS, healthy(), has_holdback=True)}
    assert all(r.verdict == "pass" for r in results.values())
    assert results["tpot"].value == pytest.approx(1.0) and results["tpot"].samples == 20

    slow = {r.guard: r for r in evaluate_guards(GUARDS, healthy(tpot_ratio=1.2), has_holdback=True)}
    assert slow["tpot"].verdict == "fail" and slow["tpot"].value == pytest.approx(1.2)
    erring = {r.guard: r for r in evaluate_guards(GUARDS, healthy(errors=2), has_holdback=True)}
    assert erring["error_rate"].verdict == "fail" and erring["error_rate"].value == pytest.approx(0.1)
    falling = {r.guard: r for r in evaluate_guards(GUARDS, healthy(fallback=10), has_holdback=True)}
    assert falling["fallback_rate"].verdict == "fail" and falling["fallback_rate"].value == pytest.approx(0.1)

    few = {r.guard: r for r in evaluate_guards(Guards(min_samples=1000), healthy(), has_holdback=True)}
    assert {few[g].verdict for g in ("error_rate", "tpot", "fallback_rate")} == {"inconclusive"}
    alone = {r.guard: r for r in evaluate_guards(GUARDS, healthy(), has_holdback=False)}
    assert alone["error_rate"].verdict == alone["tpot"].verdict == "off"  # nothing to compare with at 100%


def test_tpot_compares_only_batch_sizes_both_cohorts_ran():
    stage = Signals(
        graph=CohortSignals(step_s={1: (50, 0.05), 32: (50, 5.0)}),
        holdback=CohortSignals(step_s={1: (50, 0.10)}),
    )
    (tpot,) = [r for r in evaluate_guards(GUARDS, stage, has_holdback=True) if r.guard == "tpot"]
    assert tpot.value == pytest.approx(0.5) and tpot.samples == 50


# ---------------------------------------------------------------- the stage machine


def test_stages_advance_after_their_hold_when_every_guard_passes():
    r = Rollout.start(plan(), "r1", now=0.0, signals=Signals(), actor="alice")
    assert (r.phase, r.step, r.percent) == (Phase.PROGRESSING, 0, 5)
    assert r.evaluate(healthy(1), now=100.0) is None  # hold not over
    t = r.evaluate(healthy(2), now=300.0)
    assert (t.step, t.percent, t.actor) == (1, 25, "controller") and r.baseline == healthy(2)
    assert r.evaluate(healthy(3), now=899.0) is None
    t = r.evaluate(healthy(4), now=900.0)
    assert r.phase == Phase.SUCCEEDED and r.percent == 100 and "last step" in t.reason


def test_inconclusive_holds_the_stage_however_long():
    r = Rollout.start(plan(), "r1", now=0.0, signals=Signals(), actor="alice")
    thin = Signals(graph=CohortSignals(requests=1, rows=1), holdback=CohortSignals(requests=1, rows=1))
    for now in (300.0, 3000.0, 30000.0):
        assert r.evaluate(thin, now) is None
    assert (r.phase, r.step) == (Phase.PROGRESSING, 0)
    assert {x.verdict for x in r.results if x.guard != "shadow_verification"} == {"inconclusive"}


def test_failure_limit_rolls_back_with_the_numbers():
    r = Rollout.start(plan(), "r1", now=0.0, signals=Signals(), actor="alice")
    assert r.evaluate(healthy(1, tpot_ratio=1.5), now=10.0) is None and r.failed_evaluations == 1
    t = r.evaluate(healthy(2, tpot_ratio=1.5), now=20.0)
    assert r.phase == Phase.ROLLED_BACK and r.percent == 0 and t.percent == 0
    assert "tpot 1.5 > 1.05" in r.reason and r.guard_failures == {"tpot": 2}
    assert r.evaluate(healthy(3), now=400.0) is None  # a finished rollout stays where it ended


def test_one_shadow_mismatch_rolls_back_at_once():
    r = Rollout.start(plan(), "r1", now=0.0, signals=healthy(1), actor="alice")
    mismatch = healthy(2).model_copy(update={"shadow_mismatches": 1, "shadow_detail": "decode_bs_8: max |diff| 3.1"})
    t = r.evaluate(mismatch, now=1.0)
    assert r.phase == Phase.ROLLED_BACK and "decode_bs_8" in t.reason and r.percent == 0


def test_mismatches_before_the_stage_do_not_count():
    before = healthy(1).model_copy(update={"shadow_mismatches": 4})
    r = Rollout.start(plan(), "r1", now=0.0, signals=before, actor="alice")
    assert r.evaluate(healthy(2).model_copy(update={"shadow_mismatches": 4}), now=1.0) is None
    assert r.phase == Phase.PROGRESSING


def test_operator_actions_and_their_conflicts():
    r = Rollout.start(plan(), "r1", now=0.0, signals=Signals(), actor="alice")
    r.pause(1.0, "bob")
    assert r.phase == Phase.PAUSED and r.evaluate(healthy(1), now=1000.0) is None  # paused: no decisions
    with pytest.raises(RolloutConflict, match="Paused"):
        r.pause(2.0, "bob")
    r.resume(3.0, "bob")
    with pytest.raises(RolloutConflict):
        r.resume(4.0, "bob")
    t = r.promote(5.0, healthy(1), "carol")
    assert (t.step, t.percent, t.actor, r.phase) == (1, 25, "carol", Phase.PROGRESSING)
    r.abort(6.0, "dave")
    assert (r.phase, r.percent, r.reason) == (Phase.ABORTED, 0, "aborted")
    for action in (lambda: r.abort(7.0, "x"), lambda: r.promote(7.0, Signals(), "x"), lambda: r.pause(7.0, "x")):
        with pytest.raises(RolloutConflict):
            action()
    assert [h.actor for h in r.history] == ["alice", "alice", "bob", "bob", "carol", "dave"]


def test_promoting_the_last_step_succeeds():
    r = Rollout.start(
        plan(steps=[{"percent": 10, "hold_s": 5}, {"percent": 100, "hold_s": 60}]), "r", 0.0, Signals(), "alice"
    )
    r.promote(1.0, Signals(), "bob")
    assert (r.step, r.phase) == (1, Phase.PROGRESSING)
    r.promote(2.0, Signals(), "bob")
    assert r.phase == Phase.SUCCEEDED and r.percent == 100


def test_state_survives_a_json_round_trip():
    r = Rollout.start(plan(), "r1", now=0.0, signals=Signals(), actor="alice")
    r.evaluate(healthy(1, tpot_ratio=2.0), now=10.0)
    assert Rollout.model_validate_json(r.model_dump_json()) == r


# ---------------------------------------------------------------- permission


def test_the_toggle_wins_and_cohorts_follow_the_unit():
    tenant_plan = Rollout.start(plan(steps=[{"percent": 50}]), "r", 0.0, Signals(), "a")  # ends at 50%
    assert tenant_plan.phase == Phase.SUCCEEDED and tenant_plan.percent == 50
    assert graph_denial("t", "req", tenant_enabled=False, rule=None) == FallbackReason.TENANT_DISABLED
    assert graph_denial("t", "req", tenant_enabled=True, rule=None) is None
    tenants = [f"tenant-{i}" for i in range(200)]
    denials = {t: graph_denial(t, "same-request", True, tenant_plan.cohort_rule()) for t in tenants}
    assert set(denials.values()) == {None, FallbackReason.ROLLOUT_HOLDBACK}
    member = next(t for t, d in denials.items() if d is None)
    assert all(
        graph_denial(member, f"req-{i}", True, tenant_plan.cohort_rule()) is None for i in range(50)
    )  # all its requests
    assert (
        graph_denial(member, "r", tenant_enabled=False, rule=tenant_plan.cohort_rule())
        == FallbackReason.TENANT_DISABLED
    )
    per_request = Rollout.start(
        plan(unit="request", steps=[{"percent": 50, "hold_s": 60}, {"percent": 100}]), "r", 0.0, Signals(), "a"
    )
    assert len({graph_denial("one-tenant", f"req-{i}", True, per_request.cohort_rule()) for i in range(100)}) == 2
    per_request.abort(1.0, "a")
    assert all(graph_denial("t", f"req-{i}", True, per_request.cohort_rule()) for i in range(50))  # 0% after an abort


@pytest.mark.parametrize(
    "plan",
    [
        {"steps": [{"percent": 50.0, "hold_s": float("inf")}, {"percent": 100.0}]},
        {"steps": [{"percent": 100.0}], "guards": {"max_tpot_ratio": float("inf")}},  # answered as null: guard off
        {"steps": [{"percent": 100.0}], "guards": {"max_error_rate_delta": float("nan")}},
        {"steps": [{"percent": 100.0}], "guards": {"min_samples": 10**40}},
    ],
)
def test_a_plan_with_a_number_past_its_bounds_is_refused(plan):
    with pytest.raises(ValidationError):
        RolloutPlan.model_validate(plan)
