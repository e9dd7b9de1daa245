"""Gradual rollout of graph mode: the plan, sticky cohorts, the guards and the stage machine.

Pure (no torch, no Ray, no clock of its own: callers pass `now`), so every decision is testable in
milliseconds. The controller owns one `Rollout`, feeds it the replicas' summed signals at every
`guards.interval_s` and persists it; replicas only ask `graph_denial` which requests replay.

Semantics borrowed from Argo Rollouts and Flagger (`../shared/PRIOR_ART.md`): steps with a weight and
a hold; a guard with too few samples is inconclusive and holds the stage (never advances on missing
data); `failure_limit` failed evaluations roll back; one shadow-verification mismatch rolls back at
once; a rollback or an abort sends the cohort to 0% and stops. Cohorts are sticky like Unleash's: a
stable hash of (salt, key) against the percentage, so raising it only adds keys. A tenant's toggle
is the kill switch and wins over any rollout.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.dispatch import FallbackReason

BUCKETS = 10_000  # cohort resolution: percent * 100 of these buckets
# Evaluations at most 20 times a second: a smaller interval kept the controller busy. Checked where a
# plan starts (`GraphController.start_rollout`), not here, so that a state file of an older version
# holding a smaller one still loads (its loop runs at this interval).
MIN_INTERVAL_S = 0.05
# Bounds on what a plan may ask: a plan is persisted and echoed by every status call
MAX_INTERVAL_S = 3600.0
MAX_HOLD_S = 30 * 24 * 3600.0
MAX_STEPS = 100
MAX_SALT_CHARS = 256
MAX_COUNT = 10**9  # of samples or failed evaluations a guard may ask for


class RolloutStep(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)  # "50" is not a percent

    percent: float = Field(ge=0, le=100)
    hold_s: float | None = Field(None, ge=0, le=MAX_HOLD_S)  # the last step may omit it: reaching it ends it


class Guards(BaseModel):
    """What every evaluation checks (a None limit turns that guard off); shadow-verification
    mismatches are always checked and always critical."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)  # 1e999 parses as inf

    interval_s: float = Field(10.0, gt=0, le=MAX_INTERVAL_S)  # how often the controller evaluates (>= MIN_INTERVAL_S)
    min_samples: int = Field(50, ge=1, le=MAX_COUNT)  # per cohort, per guard, within the current stage
    failure_limit: int = Field(3, ge=1, le=MAX_COUNT)  # failed evaluations (in one stage) that roll back
    max_error_rate_delta: float | None = Field(0.01, ge=0)  # graph-cohort error rate minus holdback's
    max_tpot_ratio: float | None = Field(1.05, gt=0)  # graph-cohort decode step time / holdback's
    max_fallback_rate: float | None = Field(0.05, ge=0, le=1)  # graph-cohort rows that ran eager anyway


class RolloutPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # "50" is not a percent

    steps: list[RolloutStep] = Field(min_length=1, max_length=MAX_STEPS)
    unit: Literal["tenant", "request"] = "tenant"
    guards: Guards = Guards()
    salt: str = Field("", max_length=MAX_SALT_CHARS)

    @model_validator(mode="after")
    def _steps_in_order(self) -> RolloutPlan:
        percents = [s.percent for s in self.steps]
        if percents != sorted(percents):
            raise ValueError(f"steps: percentages must not decrease, got {percents}")
        missing = [i for i, s in enumerate(self.steps[:-1]) if s.hold_s is None]
        if missing:
            raise ValueError(f"steps: every step but the last needs hold_s (missing at {missing})")
        return self


def cohort_bucket(salt: str, key: str) -> int:
    """A stable bucket in [0, BUCKETS) for a key: the same on every replica and after every restart."""
    digest = hashlib.sha256(f"{salt}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def in_cohort(key: str, percent: float, salt: str = "") -> bool:
    return cohort_bucket(salt, key) < round(percent * BUCKETS / 100)


# -- signals --------------------------------------------------------------------------------------


class CohortSignals(BaseModel):
    """Counters of one cohort, cumulative since the replicas started (summed over replicas)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests: int = 0
    errors: int = 0
    rows: int = 0  # decode rows
    fallback_rows: int = 0  # rows that ran eager for a reason other than the rollout's holdback
    step_s: dict[int, tuple[int, float]] = {}  # batch size -> (decode steps, seconds), this cohort's calls

    def minus(self, base: CohortSignals) -> CohortSignals:
        steps = {}
        for bs, (n, s) in self.step_s.items():
            n0, s0 = base.step_s.get(bs, (0, 0.0))
            if n > n0:
                steps[bs] = (n - n0, s - s0)
        return CohortSignals(
            requests=self.requests - base.requests,
            errors=self.errors - base.errors,
            rows=self.rows - base.rows,
            fallback_rows=self.fallback_rows - base.fallback_rows,
            step_s=steps,
        )


class Signals(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    graph: CohortSignals = CohortSignals()
    holdback: CohortSignals = CohortSignals()
    shadow_checks: int = 0
    shadow_mismatches: int = 0
    shadow_detail: str | None = None  # the latest mismatch: bucket, rows, max |diff|

    def minus(self, base: Signals) -> Signals:
        return Signals(
            graph=self.graph.minus(base.graph),
            holdback=self.holdback.minus(base.holdback),
            shadow_checks=self.shadow_checks - base.shadow_checks,
            shadow_mismatches=self.shadow_mismatches - base.shadow_mismatches,
            shadow_detail=self.shadow_detail,
        )


# -- guards ---------------------------------------------------------------------------------------

Verdict = Literal["pass", "fail", "inconclusive", "off"]


class GuardResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    guard: str
    verdict: Verdict
    value: float | None = None
    limit: float | None = None
    samples: int = 0


def _rate(num: int, den: int) -> float:
    return num / den if den else 0.0


def _verdict(ok: bool) -> Verdict:
    return "pass" if ok else "fail"


def evaluate_guards(guards: Guards, stage: Signals, has_holdback: bool) -> list[GuardResult]:
    """Each guard's verdict on one stage's signals. Guards that compare with the holdback are off
    when there is none (at 100%)."""
    g, h, n = stage.graph, stage.holdback, guards.min_samples
    out = [
        GuardResult(
            guard="shadow_verification",
            verdict=_verdict(stage.shadow_mismatches == 0),
            value=stage.shadow_mismatches,
            limit=0,
            samples=stage.shadow_checks,
        )
    ]
    limit = guards.max_error_rate_delta
    if limit is None or not has_holdback:
        out.append(GuardResult(guard="error_rate", verdict="off", limit=limit))
    else:
        samples = min(g.requests, h.requests)
        delta = _rate(g.errors, g.requests) - _rate(h.errors, h.requests)
        verdict = "inconclusive" if samples < n else _verdict(delta <= limit)
        out.append(GuardResult(guard="error_rate", verdict=verdict, value=delta, limit=limit, samples=samples))
    limit = guards.max_tpot_ratio
    if limit is None or not has_holdback:
        out.append(GuardResult(guard="tpot", verdict="off", limit=limit))
    else:
        common = [bs for bs in g.step_s if bs in h.step_s]
        weights = {bs: min(g.step_s[bs][0], h.step_s[bs][0]) for bs in common}
        samples = sum(weights.values())
        ratio = None
        if samples:
            ratio = (
                sum(
                    w * (g.step_s[bs][1] / g.step_s[bs][0]) / (h.step_s[bs][1] / h.step_s[bs][0])
                    for bs, w in weights.items()
                )
                / samples
            )
        verdict = "inconclusive" if samples < n else _verdict(ratio <= limit)
        out.append(GuardResult(guard="tpot", verdict=verdict, value=ratio, limit=limit, samples=samples))
    limit = guards.max_fallback_rate
    if limit is None:
        out.append(GuardResult(guard="fallback_rate", verdict="off"))
    else:
        rate = _rate(g.fallback_rows, g.rows)
        verdict = "inconclusive" if g.rows < n else _verdict(rate <= limit)
        out.append(GuardResult(guard="fallback_rate", verdict=verdict, value=rate, limit=limit, samples=g.rows))
    return out


# -- the stage machine ----------------------------------------------------------------------------


class Phase(str, Enum):
    PROGRESSING = "Progressing"
    PAUSED = "Paused"
    SUCCEEDED = "Succeeded"
    ROLLED_BACK = "RolledBack"
    ABORTED = "Aborted"


FINISHED = (Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.ABORTED)


class Transition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    at: float
    phase: Phase
    step: int
    percent: float
    reason: str
    actor: str  # "controller" for the decision loop, else the operator


class RolloutConflict(ValueError):
    """An operator action that does not apply in the rollout's phase (the admin API's 409)."""


class Rollout(BaseModel):
    """One rollout's whole state: what the controller persists and serves. Methods change it in place
    and return the transition they made (None when nothing changed), for the audit log."""

    model_config = ConfigDict(extra="forbid")

    id: str
    plan: RolloutPlan
    phase: Phase = Phase.PROGRESSING
    step: int = 0
    stage_started_at: float
    baseline: Signals = Signals()  # the signals when the current stage began
    failed_evaluations: int = 0  # in the current stage
    guard_failures: dict[str, int] = {}  # over the whole rollout
    results: list[GuardResult] = []  # the latest evaluation
    stage_signals: Signals = Signals()  # what the latest evaluation saw
    reason: str | None = None
    history: list[Transition] = []

    @classmethod
    def start(cls, plan: RolloutPlan, rollout_id: str, now: float, signals: Signals, actor: str) -> Rollout:
        rollout = cls(id=rollout_id, plan=plan, stage_started_at=now, baseline=signals)
        rollout._record(now, "started", actor)
        rollout._enter_step(0, now, signals, actor)
        return rollout

    @property
    def percent(self) -> float:
        if self.phase in (Phase.ROLLED_BACK, Phase.ABORTED):
            return 0.0
        return self.plan.steps[self.step].percent

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED

    def cohort_rule(self) -> CohortRule:
        return CohortRule(unit=self.plan.unit, percent=self.percent, salt=self.plan.salt)

    def evaluate(self, signals: Signals, now: float) -> Transition | None:
        """One evaluation of the decision loop: roll back, hold, or advance."""
        if self.phase != Phase.PROGRESSING:
            return None
        stage = self.stage_signals = signals.minus(self.baseline)
        self.results = evaluate_guards(self.plan.guards, stage, has_holdback=self.percent < 100)
        failed = [r.guard for r in self.results if r.verdict == "fail"]
        for guard in failed:
            self.guard_failures[guard] = self.guard_failures.get(guard, 0) + 1
        if "shadow_verification" in failed:
            detail = f": {stage.shadow_detail}" if stage.shadow_detail else ""
            return self._finish(Phase.ROLLED_BACK, now, f"shadow verification mismatch{detail}", "controller")
        if failed:
            self.failed_evaluations += 1
            if self.failed_evaluations >= self.plan.guards.failure_limit:
                numbers = ", ".join(self._describe(r) for r in self.results if r.verdict == "fail")
                reason = (
                    f"{self.failed_evaluations} failed evaluations (limit {self.plan.guards.failure_limit}): {numbers}"
                )
                return self._finish(Phase.ROLLED_BACK, now, reason, "controller")
            return None
        if any(r.verdict == "inconclusive" for r in self.results):
            return None
        hold = self.plan.steps[self.step].hold_s or 0.0
        if now - self.stage_started_at < hold:
            return None
        return self._advance(now, signals, "every guard passed", "controller")

    # -- operator actions ----------------------------------------------------------------------

    def pause(self, now: float, actor: str) -> Transition:
        self._require(Phase.PROGRESSING, "pause")
        self.phase = Phase.PAUSED
        return self._record(now, "paused", actor)

    def resume(self, now: float, actor: str) -> Transition:
        self._require(Phase.PAUSED, "resume")
        self.phase = Phase.PROGRESSING
        return self._record(now, "resumed", actor)

    def promote(self, now: float, signals: Signals, actor: str) -> Transition:
        self._require((Phase.PROGRESSING, Phase.PAUSED), "promote")
        self.phase = Phase.PROGRESSING
        return self._advance(now, signals, "promoted", actor)

    def abort(self, now: float, actor: str) -> Transition:
        if self.finished:
            raise RolloutConflict(f"rollout {self.id} already ended ({self.phase.value}): nothing to abort")
        return self._finish(Phase.ABORTED, now, "aborted", actor)

    # -- internals -----------------------------------------------------------------------------

    def _require(self, phases: Phase | tuple[Phase, ...], action: str) -> None:
        phases = phases if isinstance(phases, tuple) else (phases,)
        if self.phase not in phases:
            raise RolloutConflict(f"cannot {action} rollout {self.id}: it is {self.phase.value}")

    def _advance(self, now: float, signals: Signals, reason: str, actor: str) -> Transition:
        if self.step + 1 >= len(self.plan.steps):
            return self._finish(Phase.SUCCEEDED, now, reason, actor)
        return self._enter_step(self.step + 1, now, signals, actor, reason)

    def _enter_step(self, step: int, now: float, signals: Signals, actor: str, reason: str = "") -> Transition:
        self.step, self.stage_started_at, self.baseline, self.failed_evaluations = step, now, signals, 0
        transition = self._record(now, f"step {step} at {self.percent:g}%" + (f": {reason}" if reason else ""), actor)
        last = step == len(self.plan.steps) - 1
        if last and self.plan.steps[step].hold_s is None:
            return self._finish(Phase.SUCCEEDED, now, f"reached the last step ({self.percent:g}%)", actor)
        return transition

    def _finish(self, phase: Phase, now: float, reason: str, actor: str) -> Transition:
        self.phase, self.reason = phase, reason
        return self._record(now, reason, actor)

    def _record(self, now: float, reason: str, actor: str) -> Transition:
        transition = Transition(
            at=now, phase=self.phase, step=self.step, percent=self.percent, reason=reason, actor=actor
        )
        self.history.append(transition)
        return transition

    @staticmethod
    def _describe(r: GuardResult) -> str:
        return f"{r.guard} {r.value:.4g} > {r.limit:g} ({r.samples} samples)"


class CohortRule(BaseModel):
    """What a replica needs of the rollout to place a request: the controller sends it with the toggles."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unit: Literal["tenant", "request"]
    percent: float
    salt: str = ""


def graph_denial(tenant: str, request_id: str, tenant_enabled: bool, rule: CohortRule | None) -> FallbackReason | None:
    """Why a request may not replay graphs, or None: the tenant's toggle first (the kill switch),
    then the rollout's cohort (no rollout ever started: every request may)."""
    if not tenant_enabled:
        return FallbackReason.TENANT_DISABLED
    if rule is None:
        return None
    key = tenant if rule.unit == "tenant" else request_id
    return None if in_cohort(key, rule.percent, rule.salt) else FallbackReason.ROLLOUT_HOLDBACK
