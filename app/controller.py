"""The controller actor: owner of per-tenant graph toggles, the gradual rollout of graph mode, their
audit log, and the latest status each replica reported.

Named and detached in an explicit namespace, restarted by Ray if it dies. Toggles and the audit log
are written atomically (temp file + rename) on every change and read back when the actor starts, so
a restart loses nothing. A change is persisted before it is applied: a write that fails changes
nothing and the caller gets an error. A state file that cannot be used (not JSON, or JSON
of another shape) is renamed aside to `<name>.corrupt-<UTC time>` and the actor starts from the
config's toggles, logging why: it never fails to start over its file (with unlimited restarts that
would be a crash loop). Replicas poll `get_permissions()` (a cheap version check: toggles and the
rollout's cohort) and push their status; the ingress reads statuses for /admin/status, /readyz and
/metrics.

The rollout (`policies/rollout.py` decides) is persisted with the toggles, in the same file, and
resumed after a restart. Its decision loop is an asyncio task of the actor, started by the first call
that finds none running: every `guards.interval_s` it sums the replicas' reported cohort signals and
lets the rollout advance, hold or roll back; each transition is persisted and audited.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import ray
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from app.auth import Operator
from app.config import AppConfig
from policies.bucket_choice import best_buckets, graph_memory_mb, ladder_cost
from policies.model_swap import Swap, SwapPhase, SwapRequest
from policies.rollout import MIN_INTERVAL_S, CohortSignals, Rollout, RolloutConflict, RolloutPlan, Signals
from policies.tenant_toggles import reconciled_toggles

log = logging.getLogger(__name__)

AUDIT_KEEP = 1000
DEFAULT_RECOMMENDED_BUCKETS = 8
STALE_AFTER_S = 10.0
# A replica of a swap silent this long at its step is dropped from it (gone: Serve replaces it, and its
# successor joins): waiting for its turn, or in it (draining, loading: a live one reports every second
# whatever its engine does; a dead one's turn blocked every swap, policy change and rollout until
# replica_timeout_s, 30 min by default)
GONE_AFTER_S = {"waiting": 30.0, "draining": 120.0, "loading": 120.0}
DECIDE_EVERY_S = 1.0  # the decision loop's pause with no rollout running


class _AuditEntry(BaseModel):
    """A toggle change (tenant, before, after) or a rollout transition (rollout_id, phase, reason)."""

    model_config = ConfigDict(extra="allow")
    time: StrictFloat
    actor: StrictStr
    action: StrictStr
    tenant: StrictStr | None = None
    before: StrictBool | None = None
    after: StrictBool | None = None


class _State(BaseModel):
    """The shape of the state file (what `_write_state` writes)."""

    toggles: dict[str, StrictBool]
    configured_toggles: dict[str, StrictBool] | None = None  # the configuration's tenants the toggles started from
    audit: list[_AuditEntry]
    version: StrictInt = Field(ge=0)
    rollout: Rollout | None = None
    rollouts_started: StrictInt = Field(0, ge=0)
    swap: Swap | None = None
    swaps_started: StrictInt = Field(0, ge=0)
    serving_model: dict[str, Any] | None = None  # what a replica starting now loads: the last swap's target
    lora_adapters: dict[str, dict[str, Any]] = {}  # adapters registered through the admin API
    made_for: dict[str, Any] | None = None  # the configuration (AppConfig.made_for) the swap state is valid for
    archived: list[dict[str, Any]] = []  # swap state set aside when the configuration changed
    tenant_updates: dict[str, dict[str, Any]] | None = None  # per tenant, its toggle's last change: at, by
    applied_calls: list[StrictStr] = []  # the ids of the last calls whose change was persisted


PERSISTED = (
    "toggles",
    "configured_toggles",
    "rollout",
    "rollouts_started",
    "swap",
    "swaps_started",
    "serving_model",
    "lora_adapters",
    "made_for",
    "archived",
    "tenant_updates",
    "applied_calls",
)
ARCHIVE_KEEP = 20
APPLIED_KEEP = 1000  # call ids remembered: a call retried after a restart that persisted it is answered, not run again


class StateWriteError(RuntimeError):
    """The state file could not be written: the change it carried was not made."""


def signals_from_statuses(statuses: dict[str, dict]) -> Signals:
    """The rollout's signals: each replica's cohort counters (engine rows and model calls, replica
    requests and errors) summed over replicas."""
    sums = {c: {"requests": 0, "errors": 0, "rows": 0, "fallback_rows": 0, "step_s": {}} for c in ("graph", "holdback")}
    checks = mismatches = 0
    detail = None
    for status in statuses.values():
        engine = status.get("stats", {}).get("cohorts", {})
        requests = status.get("requests", {}).get("cohorts", {})
        for cohort, total in sums.items():
            for key in ("rows", "fallback_rows"):
                total[key] += engine.get(cohort, {}).get(key, 0)
            for key in ("requests", "errors"):
                total[key] += requests.get(cohort, {}).get(key, 0)
            for rows, (calls, seconds) in engine.get(cohort, {}).get("calls", {}).items():
                n, t = total["step_s"].get(int(rows), (0, 0.0))
                total["step_s"][int(rows)] = (n + calls, t + seconds)
        shadow = status.get("stats", {}).get("shadow", {})
        checks += shadow.get("checks", 0)
        mismatches += shadow.get("mismatches", 0)
        detail = shadow.get("last_mismatch") or detail
    return Signals(
        graph=CohortSignals(**sums["graph"]),
        holdback=CohortSignals(**sums["holdback"]),
        shadow_checks=checks,
        shadow_mismatches=mismatches,
        shadow_detail=detail,
    )


def _invalid(e: ValidationError) -> dict:
    """A 400 answer naming the first invalid field."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    message = err["msg"].removeprefix("Value error, ")  # pydantic's wording around a validator's own message
    return {"error": f"{where}: {message}" if where else message, "status": 400, "field": where or None}


def _shadow_mismatches(status: dict) -> int:
    return (status.get("stats") or {}).get("shadow", {}).get("mismatches", 0)


def _read_state(path: Path) -> dict[str, Any] | None:
    """The persisted state, or None (no file, or one that cannot be used: then logged, and a
    corrupt one is renamed aside so that it is kept but never read again)."""
    if not path.is_file():
        return None
    try:
        raw = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        log.error("controller state %s is unreadable (%s); starting from the config's toggles", path, e)
        return None
    try:
        state = json.loads(raw)
        _State.model_validate(state)
    except json.JSONDecodeError as e:
        reason = f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except RecursionError:
        reason = "not valid JSON (nested too deep)"
    except ValidationError as e:
        err = e.errors()[0]
        reason = f"not a state file ({'.'.join(map(str, err['loc'])) or 'top level'}: {err['msg']})"
    else:
        return state
    aside = path.with_name(f"{path.name}.corrupt-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S.%fZ')}")
    try:
        path.rename(aside)
    except OSError as e:
        log.error(
            "controller state %s is %s and could not be renamed aside (%s); starting from the config's toggles",
            path,
            reason,
            e,
        )
        return None
    log.error("controller state %s is %s; kept as %s, starting from the config's toggles", path, reason, aside.name)
    return None


def _write_state(path: Path, state: dict[str, Any]) -> None:
    """Write `state` to `path` atomically: a temp file in the same directory, fsynced, renamed over
    it; on any failure the temp file is removed and the old file stays as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable; not every file system can fsync a directory
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class GraphController:
    def __init__(self, state_path: str, initial_toggles: dict[str, bool], made_for: dict | None = None) -> None:
        """made_for: the configuration of the deployment that creates the actor (`AppConfig.made_for`);
        swap state persisted for another one is archived (`adopt`)."""
        self.path = Path(state_path)
        self.toggles = dict(initial_toggles)
        self.configured_toggles = dict(initial_toggles)  # the configuration's `tenants` the toggles started from
        self.audit: list[dict] = []
        self.version = 0
        self.replicas: dict[str, dict] = {}
        self.rollout: Rollout | None = None
        self.rollouts_started = 0
        self.swap: Swap | None = None
        self.swaps_started = 0
        self.serving_model: dict | None = None
        self.lora_adapters: dict[str, dict] = {}  # registered through the admin API: name -> path, by, at
        self.made_for: dict | None = None
        self.archived: list[dict] = []
        self.tenant_updates: dict[str, dict] = {}
        self.applied_calls: list[str] = []
        self._call_id: str | None = None  # the id of the call running now, persisted with its change
        self._loop: asyncio.Task | None = None
        self._evaluated: tuple[str, float] = ("", 0.0)  # the rollout the loop last evaluated (or first saw), when
        state = _read_state(self.path)
        if state is not None:
            configured = state.get("configured_toggles")
            if configured is None:  # a file of an earlier version: the configuration's tenants, then the file's
                self.toggles = {**initial_toggles, **state["toggles"]}
            else:
                self.toggles, self.configured_toggles = dict(state["toggles"]), configured
            self.audit = state["audit"][-AUDIT_KEEP:]
            self.version = state["version"]
            self.rollout = Rollout.model_validate(state["rollout"]) if state.get("rollout") else None
            self.rollouts_started = state.get("rollouts_started", 0)
            self.swap = Swap.model_validate(state["swap"]) if state.get("swap") else None
            self.swaps_started = state.get("swaps_started", 0)
            self.serving_model = state.get("serving_model")
            self.lora_adapters = state.get("lora_adapters", {})
            self.made_for = state.get("made_for")
            self.archived = state.get("archived", [])
            updates = state.get("tenant_updates")
            self.tenant_updates = _updates_from_audit(self.audit) if updates is None else updates
            self.applied_calls = state.get("applied_calls", [])
        if made_for is not None:
            self.adopt(made_for, "controller")
        self._configure_toggles(initial_toggles, "controller")

    # -- the configuration the swap state belongs to -----------------------------------------------

    def adopt(
        self,
        made_for: dict,
        actor: str,
        replica_id: str | None = None,
        configured_toggles: dict[str, bool] | None = None,
    ) -> dict | None:
        """Bind the persisted swap state to the configuration `made_for` and return what a replica
        of it starting now loads (the last swap's target; None: the configured model). A starting
        `replica_id` joins a running swap in the same call, before the swap can finish: it loads
        the previous model and swaps in its turn, never left on it unnoticed. State made
        for another configuration (another model, revision or graph policy, or a file that does not
        say) is archived, not deleted, with an audit entry and a log line: the configuration wins.
        Toggles and rollouts stay; adapters registered through the admin API are archived only when
        the configured model is known to have changed (they were trained for the old one).
        `configured_toggles`: the configuration's `tenants`, applied as `reconciled_toggles` says."""
        if made_for != self.made_for:
            self._archive_for(made_for, actor)
        if configured_toggles is not None:
            self._configure_toggles(configured_toggles, actor)
        if replica_id is not None:
            self._join_swap(replica_id)
        return self.serving_model

    def _archive_for(self, made_for: dict, actor: str) -> None:
        stale = {"serving_model": self.serving_model, "swap": self.current_swap()}
        if self.made_for is not None and made_for.get("model") != self.made_for.get("model"):
            stale["lora_adapters"] = self.lora_adapters
        stale = {k: v for k, v in stale.items() if v}
        changes: dict[str, Any] = {"made_for": made_for}
        entries = []
        if stale:
            changed = sorted(k for k in made_for if (self.made_for or {}).get(k) != made_for[k])
            reason = (
                "the state file does not say which configuration it was made for"
                if self.made_for is None
                else f"the configuration's {', '.join(changed)} changed"
            )
            at = time.time()
            record = {"at": at, "reason": reason, "made_for": self.made_for, **stale}
            changes.update(
                serving_model=None,
                swap=None,
                archived=[*self.archived, record][-ARCHIVE_KEEP:],
                **({"lora_adapters": {}} if "lora_adapters" in stale else {}),
            )
            entries.append(
                {
                    "time": at,
                    "actor": actor,
                    "action": "archive_swap_state",
                    "reason": reason,
                    "archived": sorted(stale),
                    "serving_model": self.serving_model,
                    "swap_id": self.swap.id if self.swap else None,
                }
            )
            log.warning(
                "controller state %s: %s; archived %s (kept in the file's `archived`), serving the configured model %s",
                self.path,
                reason,
                ", ".join(sorted(stale)),
                made_for.get("model"),
            )
        self._commit_or_apply(entries, "the new configuration", **changes)

    def _configure_toggles(self, configured: dict[str, bool], actor: str) -> None:
        """Take the configuration's `tenants` when they differ from those the toggles started from."""
        if configured == self.configured_toggles:
            return
        toggles = reconciled_toggles(self.toggles, self.configured_toggles, configured)
        at = time.time()
        entries = [
            {
                "time": at,
                "actor": actor,
                "tenant": tenant,
                "action": "configure_cuda_graph",
                "before": self.toggles.get(tenant, True),
                "after": toggles.get(tenant, True),
            }
            for tenant in sorted(self.toggles.keys() | toggles.keys())
            if self.toggles.get(tenant, True) != toggles.get(tenant, True)
        ]
        if entries:
            log.warning("controller state %s: the configuration's tenants changed: %s", self.path, entries)
        self._commit_or_apply(
            entries,
            "the configuration's tenants",
            toggles=toggles,
            configured_toggles=configured,
            tenant_updates={**self.tenant_updates, **_updates_from_audit(entries)},
        )

    def get_toggles(self, known_version: int = -1) -> tuple[int, dict[str, bool] | None]:
        """(version, toggles); toggles is None when the caller already has this version."""
        return self.version, (None if known_version == self.version else dict(self.toggles))

    async def get_permissions(self, known_version: int = -1) -> tuple[int, dict | None]:
        """(version, {"toggles", "rollout", "swap", "serving_model"}) for replicas, None when the
        caller has this version. "rollout" is the cohort rule in force ({unit, percent, salt}) or
        None (none ever started); "swap" the running swap's order; "serving_model" what a replica
        starting now loads (None: its config's model)."""
        self.ensure_decision_loop()
        if known_version == self.version:
            return self.version, None
        return self.version, {
            "toggles": dict(self.toggles),
            "rollout": self._cohort_rule(),
            "swap": self._swap_order(),
            "serving_model": self.serving_model,
        }

    def _swap_order(self) -> dict | None:
        """What replicas need of a running swap: its id, kind, target, and who swaps now."""
        if self.swap is None or self.swap.phase != SwapPhase.PROGRESSING:
            return None
        s = self.swap
        return {
            "id": s.id,
            "kind": s.kind,
            "target": s.target,
            "drain_timeout_s": s.drain_timeout_s,
            "now": s.now_swapping(),
        }

    def _cohort_rule(self) -> dict | None:
        return None if self.rollout is None else self.rollout.cohort_rule().model_dump()

    def tenant(self, tenant: str) -> dict:
        last = self.tenant_updates.get(tenant, {})
        return {
            "tenant": tenant,
            "cuda_graph": self.toggles.get(tenant, True),
            "updated_at": last.get("at"),
            "updated_by": last.get("by"),
        }

    def set_toggle(self, tenant: str, enabled: bool, operator: Operator) -> dict:
        """Set a tenant's graph permission: the new state is written first and only then applied; a
        failed write leaves toggles, version and audit as they were and returns {"error": why}. A set
        that changes nothing returns the current state without an audit entry or a version bump: a
        call Ray retries after a restart (max_task_retries=-1) that had already been persisted is then
        a no-op instead of a second audit entry."""
        before = self.toggles.get(tenant, True)
        if before == enabled:
            return self.tenant(tenant)
        entry = {
            "time": time.time(),
            "actor": operator.name,
            "client": operator.client,
            "tenant": tenant,
            "action": "set_cuda_graph",
            "before": before,
            "after": enabled,
        }
        try:
            self._commit(
                [entry],
                toggles={**self.toggles, tenant: enabled},
                tenant_updates={**self.tenant_updates, **_updates_from_audit([entry])},
            )
        except StateWriteError as e:
            log.error("%s; toggle of %s not changed", e, tenant)
            return {"error": f"the toggle was not changed: {e}"}
        return self.tenant(tenant)

    # -- LoRA adapters ---------------------------------------------------------------------------

    def get_lora_adapters(self) -> dict[str, dict]:
        return dict(self.lora_adapters)

    def lora_refusals(self) -> dict[str, dict]:
        """The adapters a live replica refused (its last load of it, or its screening at start)
        and none holds in a slot, name -> {"path", "reason"}: one configuration refuses them on
        every replica, and one that loaded an adapter since (its files mended) serves it."""
        refused: dict[str, dict] = {}
        held: set[str] = set()
        for _, status in sorted(self.replica_statuses().items()):
            lora = status.get("lora") or {}
            held.update(lora.get("adapters") or {})
            for name, why in (lora.get("refused") or {}).items():
                refused.setdefault(name, why)
        return {name: why for name, why in refused.items() if name not in held}

    def add_lora_adapter(self, name: str, path: str, operator: Operator) -> dict:
        """Register an adapter (the ingress has had a replica load and verify it). Registering a
        name again with the same path changes nothing; with another path it replaces the entry
        (replicas load the new one on its next request)."""
        before = self.lora_adapters.get(name)
        if before is not None and before["path"] == path:
            return {"name": name, **before}
        entry = {"path": path, "added_by": operator.name, "added_at": time.time()}
        audit = {
            "time": entry["added_at"],
            "actor": operator.name,
            "client": operator.client,
            "action": "add_lora_adapter",
            "adapter": name,
            "path": path,
            "replaced_path": before and before["path"],
        }
        try:
            self._commit([audit], lora_adapters={**self.lora_adapters, name: entry})
        except StateWriteError as e:
            return {"error": f"the adapter was not registered: {e}"}
        return {"name": name, **entry}

    def remove_lora_adapter(self, name: str, operator: Operator) -> dict:
        entry = self.lora_adapters.get(name)
        if entry is None:
            return {"error": f"no adapter {name!r} was registered through the admin API", "status": 404}
        audit = {
            "time": time.time(),
            "actor": operator.name,
            "client": operator.client,
            "action": "remove_lora_adapter",
            "adapter": name,
            "path": entry["path"],
        }
        try:
            self._commit([audit], lora_adapters={k: v for k, v in self.lora_adapters.items() if k != name})
        except StateWriteError as e:
            return {"error": f"the adapter was not removed: {e}", "status": 409}
        return {"name": name, "removed": True}

    def _commit(self, entries: list[dict], **changes: Any) -> None:
        """Persist the state with these changes (attributes named in PERSISTED) and one version
        more, then apply them; a failed write applies nothing and raises StateWriteError. The id of
        the call making them goes with them (`before`)."""
        values = {name: changes.get(name, getattr(self, name)) for name in PERSISTED}
        if self._call_id is not None:
            values["applied_calls"] = [*self.applied_calls, self._call_id][-APPLIED_KEEP:]
        audit, version = [*self.audit, *entries][-AUDIT_KEEP:], self._next_version(entries, changes)
        dumped = {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in values.items()}
        state = {"audit": audit, "version": version, **dumped}
        try:
            _write_state(self.path, state)
        except OSError as e:
            raise StateWriteError(
                f"the controller could not write its state file {self.path} ({e.strerror or e})"
            ) from e
        self.audit, self.version = audit, version
        for name, value in values.items():
            setattr(self, name, value)

    def _next_version(self, entries: list[dict], changes: dict[str, Any]) -> int:
        """The version replicas poll moves with every audited change; recording which configuration
        the state belongs to alone changes nothing they read."""
        return self.version + (1 if entries or set(changes) - {"made_for"} else 0)

    def _commit_or_apply(self, entries: list[dict], what: str, **changes: Any) -> None:
        """Commit a decision the controller made itself (a rollback, a swap's progress); when the
        state cannot be written it is applied in memory anyway, since it must not wait for a disk."""
        try:
            self._commit(entries, **changes)
        except StateWriteError as e:
            log.error("%s; %s goes on in memory", e, what)
            self.audit, self.version = [*self.audit, *entries][-AUDIT_KEEP:], self._next_version(entries, changes)
            for name, value in changes.items():
                setattr(self, name, value)

    # -- rollout ---------------------------------------------------------------------------------

    def start_rollout(self, plan: dict, operator: Operator) -> dict:
        """Start a rollout of `plan` (validated): {"rollout": ...}, or {"error", "status"}: 400 for an
        invalid plan, 409 while another is running or when the state cannot be written."""
        try:
            parsed = RolloutPlan.model_validate(plan)
        except ValidationError as e:
            return _invalid(e)
        if parsed.guards.interval_s < MIN_INTERVAL_S:
            return {"error": f"guards.interval_s: must be at least {MIN_INTERVAL_S} s", "status": 400}
        if self.rollout is not None and not self.rollout.finished:
            return {"error": f"rollout {self.rollout.id} is {self.rollout.phase.value}; abort it first", "status": 409}
        if self.swap is not None and self.swap.phase == SwapPhase.PROGRESSING:
            return {"error": f"swap {self.swap.id} is in progress; start the rollout after it", "status": 409}
        rollout_id = f"rollout-{self.rollouts_started + 1}"
        rollout = Rollout.start(parsed, rollout_id, time.time(), self.signals(), operator.name)
        try:
            self._commit(
                self._audit_entries(rollout, rollout.history, operator.client),
                rollout=rollout,
                rollouts_started=self.rollouts_started + 1,
            )
        except StateWriteError as e:
            return {"error": f"the rollout was not started: {e}", "status": 409}
        return {"rollout": self.current_rollout()}

    def current_rollout(self) -> dict | None:
        """The most recent rollout, finished or not (None if none ever ran), with the latest guard
        results and the stage's cohort signals behind them."""
        if self.rollout is None:
            return None
        r = self.rollout
        return {
            "id": r.id,
            "phase": r.phase.value,
            "step": r.step,
            "percent": r.percent,
            "reason": r.reason,
            "plan": r.plan.model_dump(mode="json"),
            "stage_started_at": r.stage_started_at,
            "failed_evaluations": r.failed_evaluations,
            "guard_failures": dict(r.guard_failures),
            "guards": [g.model_dump(mode="json") for g in r.results],
            "signals": r.stage_signals.model_dump(mode="json"),
            "history": [t.model_dump(mode="json") for t in r.history],
        }

    def rollout_action(self, action: str, operator: Operator) -> dict:
        """pause, resume, promote or abort the current rollout: {"rollout": ...} or {"error", "status"}."""
        if self.rollout is None:
            return {"error": "no rollout has been started", "status": 404}
        rollout = self.rollout.model_copy(deep=True)
        now = time.time()
        try:
            if action == "promote":
                rollout.promote(now, self.signals(), operator.name)
            else:
                act = {"pause": rollout.pause, "resume": rollout.resume, "abort": rollout.abort}[action]
                act(now, operator.name)
        except RolloutConflict as e:
            return {"error": str(e), "status": 409}
        try:
            self._commit(self._audit_entries(rollout, self._new_transitions(rollout), operator.client), rollout=rollout)
        except StateWriteError as e:
            return {"error": f"the rollout was not changed: {e}", "status": 409}
        return {"rollout": self.current_rollout()}

    # -- model swap --------------------------------------------------------------------------------

    def start_swap(self, kind: str, body: dict, previous: dict, operator: Operator) -> dict:
        """Start a rolling swap: kind "model" (body: a SwapRequest) or "graph_policy" (body: the new
        policy, validated by the caller). {"swap": ...}, or {"error", "status"}: 400 for an invalid
        body, 409 while a swap or a rollout runs, when no replica is READY, or when the state cannot
        be written. `previous` is what the replicas serve now (the ingress knows the config)."""
        request = None
        if kind == "model":
            try:
                request = SwapRequest.model_validate(body)
            except ValidationError as e:
                return _invalid(e)
            target = {"model": request.model, "revision": request.revision}
        else:
            target = {"graph_policy": body}
        if self.swap is not None and self.swap.phase == SwapPhase.PROGRESSING:
            return {"error": f"swap {self.swap.id} is in progress", "status": 409}
        if self.rollout is not None and not self.rollout.finished:
            return {
                "error": f"rollout {self.rollout.id} is {self.rollout.phase.value}; finish or abort it first",
                "status": 409,
            }
        statuses = self.replica_statuses()
        ready = sorted(r for r, st in statuses.items() if st.get("state") == "READY")
        if not ready:
            return {"error": "no replica is READY to swap", "status": 409}
        # Replicas still starting loaded the previous model: they swap after the READY ones.
        starting = sorted(r for r, st in statuses.items() if r not in ready and st.get("state") != "FAILED")
        swap_id = f"swap-{self.swaps_started + 1}"
        swap = Swap.begin(
            swap_id,
            kind,
            request,
            target,
            {**previous, **(self.serving_model or {})},
            ready + starting,
            operator.name,
            time.time(),
        )
        entry = {
            "time": swap.started_at,
            "actor": operator.name,
            "client": operator.client,
            "action": "swap",
            "swap_id": swap_id,
            "kind": kind,
            "phase": swap.phase.value,
            "target": target,
            "replicas": swap.order,
        }
        try:
            self._commit([entry], swap=swap, swaps_started=self.swaps_started + 1)
        except StateWriteError as e:
            return {"error": f"the swap was not started: {e}", "status": 409}
        return {"swap": self.current_swap()}

    def current_swap(self) -> dict | None:
        """The most recent swap, finished or not, with each replica's step; None if none ever ran."""
        return None if self.swap is None else self.swap.model_dump(mode="json")

    def _swap_reported(self, replica_id: str, reported: dict | None) -> None:
        """A replica's swap progress from its status; each step it reaches is persisted and audited."""
        if not reported or self.swap is None or reported.get("id") != self.swap.id:
            return
        before = self.swap.replicas.get(replica_id)
        if before is None or reported.get("step") == before.step:
            return
        swap = self.swap.model_copy(deep=True)
        reason = swap.record(
            replica_id, reported.get("step", ""), time.time(), reported.get("detail"), reported.get("path")
        )
        if swap.replicas[replica_id].step == before.step:
            return
        self._swap_changed(swap, replica_id, reason)

    def _swap_changed(self, swap: Swap, replica_id: str | None, reason: str | None) -> None:
        entries = []
        if replica_id is not None:
            progress = swap.replicas[replica_id]
            entries.append(
                {
                    "time": time.time(),
                    "actor": "controller",
                    "action": "swap",
                    "swap_id": swap.id,
                    "replica": replica_id,
                    "step": progress.step,
                    "detail": progress.detail,
                }
            )
        changes: dict[str, Any] = {"swap": swap}
        if reason is not None:
            entries.append(
                {
                    "time": time.time(),
                    "actor": "controller",
                    "action": "swap",
                    "swap_id": swap.id,
                    "phase": swap.phase.value,
                    "reason": reason,
                }
            )
            log.warning("swap %s: %s (%s)", swap.id, reason, swap.phase.value)
            if swap.phase == SwapPhase.SUCCEEDED:
                changes["serving_model"] = {**(self.serving_model or {}), **swap.target}
        self._commit_or_apply(entries, f"swap {swap.id}", **changes)

    def check_swap(self, now: float | None = None) -> None:
        """One look of the decision loop at a running swap: a replica that overran its time fails it."""
        if self.swap is None or self.swap.phase != SwapPhase.PROGRESSING:
            return
        now = time.time() if now is None else now
        swap = self.swap.model_copy(deep=True)
        gone = [
            r
            for r in swap.order
            if swap.replicas[r].step in GONE_AFTER_S
            and r in self.replicas
            and now - self.replicas[r]["reported_at"] > GONE_AFTER_S[swap.replicas[r].step]
        ]
        reason = None
        for replica_id in gone:  # Serve replaces a replica that died: its successor joins the swap instead
            log.warning(
                "swap %s: replica %s (%s) has not reported for %.0f s; dropped from the swap",
                swap.id,
                replica_id,
                swap.replicas[replica_id].step,
                now - self.replicas[replica_id]["reported_at"],
            )
            reason = swap.leave(replica_id, now) or reason
        reason = swap.check_timeouts(now) or reason
        if gone or reason is not None:
            self._swap_changed(swap, None, reason)

    # -- bucket recommendation -------------------------------------------------------------------

    def bucket_recommendation(self, max_buckets: int | None) -> dict:
        """The bucket ladder of at most max_buckets sizes (default: as many as now) that would have
        padded least on the decode batch sizes the replicas ran, against the current ladder."""
        histogram: Counter[int] = Counter()
        current: set[int] = set()
        memory: dict[int, float] = {}
        for status in self.replica_statuses().values():
            for size, steps in (status.get("stats") or {}).get("decode_batch_sizes", {}).items():
                histogram[int(size)] += steps
            for name, bucket in (status.get("buckets") or {}).items():
                size = int(name.rsplit("_", 1)[1])
                current.add(size)
                if bucket.get("memory_mb"):
                    memory[size] = max(memory.get(size, 0.0), bucket["memory_mb"])
        if not histogram:
            return {"error": "no replica has reported a decode step yet: nothing to recommend from", "status": 409}
        n = max_buckets or len(current) or DEFAULT_RECOMMENDED_BUCKETS
        now, best = ladder_cost(histogram, sorted(current)), ladder_cost(histogram, best_buckets(histogram, n))
        return {
            "max_buckets": n,
            "decode_steps": sum(histogram.values()),
            "batch_sizes": dict(sorted(histogram.items())),
            "recommended": {
                "buckets": list(best.buckets),
                "padding_waste": best.padding_waste,
                "graph_hit_rate": best.graph_hit_rate,
                "graph_memory_mb": graph_memory_mb(best.buckets, memory),
            },
            "current": {
                "buckets": list(now.buckets),
                "padding_waste": now.padding_waste,
                "graph_hit_rate": now.graph_hit_rate,
                "graph_memory_mb": graph_memory_mb(now.buckets, memory),
            },
        }

    def signals(self) -> Signals:
        return signals_from_statuses(self.replicas)

    def evaluate_rollout(self, now: float | None = None) -> None:
        """One evaluation of the decision loop. A transition is applied even when its write fails
        (a rollback must not wait for a disk), and the failure is logged."""
        if self.rollout is None or self.rollout.phase.value != "Progressing":
            return
        rollout = self.rollout.model_copy(deep=True)
        transition = rollout.evaluate(self.signals(), time.time() if now is None else now)
        if transition is None:
            self.rollout = rollout  # the latest results and signals, for /admin/rollouts/current
            return
        log.warning("rollout %s: %s (%s)", rollout.id, transition.reason, rollout.phase.value)
        entries = self._audit_entries(rollout, self._new_transitions(rollout))
        self._commit_or_apply(entries, f"rollout {rollout.id} ({transition.reason})", rollout=rollout)

    def ensure_decision_loop(self) -> None:
        """Start the decision loop if it is not running. Called from `get_permissions`, which every
        replica calls twice a second, so the loop runs soon after the actor (re)starts."""
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._decide_forever())

    async def _decide_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.decide_every_s(), DECIDE_EVERY_S))
            try:
                if self.rollout_due(time.monotonic()):
                    self.evaluate_rollout()
                self.check_swap()
            except Exception:
                log.exception("rollout evaluation failed")

    def decide_every_s(self) -> float:
        """How often the running rollout is evaluated: its `guards.interval_s`, else a second (the
        pending swap's check); a finished rollout's interval no longer counts. The loop wakes at
        least every second whatever it is, so a rollout started meanwhile never waits out the
        last one's interval."""
        if self.rollout is None or self.rollout.finished:
            return DECIDE_EVERY_S
        return max(self.rollout.plan.guards.interval_s, MIN_INTERVAL_S)

    def rollout_due(self, now: float) -> bool:
        """Whether the running rollout's interval has passed since it was last evaluated (or since
        the loop first saw it)."""
        if self.rollout is None or self.rollout.finished:
            return False
        rollout_id, at = self._evaluated
        if rollout_id != self.rollout.id:
            self._evaluated = (self.rollout.id, now)
            return False
        if now - at < self.decide_every_s():
            return False
        self._evaluated = (rollout_id, now)
        return True

    def _new_transitions(self, changed: Rollout) -> list:
        """What a changed copy of the current rollout has recorded since (one action may record two,
        as a promotion into a last step without a hold does)."""
        return changed.history[len(self.rollout.history) :]

    @staticmethod
    def _audit_entries(rollout: Rollout, transitions: list, client: str | None = None) -> list[dict]:
        """The audit entries of a rollout's transitions; `client`: the address of the operator's call
        that made them (None for the decision loop's own)."""
        return [
            {
                "time": t.at,
                "actor": t.actor,
                "client": client,
                "action": "rollout",
                "rollout_id": rollout.id,
                "phase": t.phase.value,
                "step": t.step,
                "percent": t.percent,
                "reason": t.reason,
            }
            for t in transitions
        ]

    def audit_log(self, limit: int = 100) -> list[dict]:
        return self.audit[-limit:]

    def report(self, replica_id: str, status: dict) -> None:
        """Keep a replica's status. One that brings a new shadow-verification mismatch is acted on at
        once, not at the next interval: a mismatch is critical, and its rollback should not wait."""
        before = self.replicas.get(replica_id, {})
        self.replicas[replica_id] = {**status, "reported_at": time.time()}
        if _shadow_mismatches(status) > _shadow_mismatches(before):
            self.evaluate_rollout()
        if status.get("model_fallback") and not before.get("model_fallback"):
            fallback = status["model_fallback"]
            self._commit_or_apply(
                [
                    {
                        "time": time.time(),
                        "actor": "controller",
                        "action": "model_fallback",
                        "replica": replica_id,
                        **fallback,
                    }
                ],
                f"replica {replica_id}'s fallback",
            )
        self._swap_reported(replica_id, status.get("swap"))

    def _join_swap(self, replica_id: str) -> None:
        """A replica starting while a swap runs (it loads the previous model) takes its turn after
        the others."""
        if self.swap is None or self.swap.phase != SwapPhase.PROGRESSING or replica_id in self.swap.replicas:
            return
        swap = self.swap.model_copy(deep=True)
        swap.join(replica_id)
        entry = {
            "time": time.time(),
            "actor": "controller",
            "action": "swap",
            "swap_id": swap.id,
            "replica": replica_id,
            "step": "joined",
        }
        log.warning("swap %s: replica %s started during the swap; it swaps in its turn", swap.id, replica_id)
        self._commit_or_apply([entry], f"swap {swap.id}", swap=swap)

    def leave(self, replica_id: str) -> None:
        """A replica Serve is stopping: out of the statuses now rather than STALE_AFTER_S later (a
        redeploy's readiness and /admin/model show no ghost), and out of a swap's order at its next
        check, as one that stopped reporting long ago."""
        status = self.replicas.get(replica_id)
        if status is not None:
            status["reported_at"] = 0.0

    def replica_statuses(self) -> dict[str, dict]:
        now = time.time()
        return {rid: s for rid, s in self.replicas.items() if now - s["reported_at"] < STALE_AFTER_S}

    async def before(self, deadline: float, name: str, args: tuple, kwargs: dict, call_id: str | None = None) -> Any:
        """Method `name`'s answer, unless its caller stopped waiting for it before it got here
        (`deadline`, epoch seconds): a call held by a stalled or restarting actor (or retried by
        Ray after a restart) must not act after its caller was told it failed. An admin write
        answered 503 changes nothing, then or later. A call whose change was persisted before the
        actor died (`call_id` among `applied_calls`), retried by Ray or by the client, is answered
        with the state it made (REPLAYED) instead of being run again: a second pause would be a
        409 for a pause that took effect, a second start another rollout."""
        if time.time() > deadline:
            raise CallExpired(f"{name} reached the controller after its caller stopped waiting; it was not run")
        if call_id is not None and call_id in self.applied_calls and name in REPLAYED:
            log.info("%s %s was applied before the controller restarted; answered, not run again", name, call_id)
            return REPLAYED[name](self, *args, **kwargs)
        self._call_id = call_id  # only while the method's synchronous part runs: an async one persists nothing
        try:
            result = getattr(self, name)(*args, **kwargs)
        finally:
            self._call_id = None
        return await result if inspect.isawaitable(result) else result


def _updates_from_audit(entries: list[dict]) -> dict[str, dict]:
    """Per tenant, the last of these audit entries that changed its toggle: when, and by whom."""
    return {a["tenant"]: {"at": a["time"], "by": a["actor"]} for a in entries if a.get("tenant") is not None}


# What a write answers when its change is already in place (a retried call the controller had
# persisted before it died): the state it made, as the call itself answers it.
REPLAYED: dict[str, Callable[..., dict]] = {
    "set_toggle": lambda c, tenant, enabled, operator: c.tenant(tenant),
    "start_rollout": lambda c, plan, operator: {"rollout": c.current_rollout()},
    "rollout_action": lambda c, action, operator: {"rollout": c.current_rollout()},
    "start_swap": lambda c, kind, body, previous, operator: {"swap": c.current_swap()},
    "add_lora_adapter": lambda c, name, path, operator: {"name": name, **c.lora_adapters.get(name, {"path": path})},
    "remove_lora_adapter": lambda c, name, operator: {"name": name, "removed": True},
}


class ControllerUnavailable(RuntimeError):
    """The controller did not answer a call within controller_timeout_s."""


class CallExpired(RuntimeError):
    """A call reached the controller after its deadline; it was not run."""


P = ParamSpec("P")
R = TypeVar("R")
ControllerMethod = Callable[Concatenate[GraphController, P], R | Awaitable[R]]


class ControllerClient:
    """Calls the controller, each call bounded by `controller_timeout_s` (a restarting actor holds
    calls until it is back); if the actor is gone for good (killed without restart), creates it
    again, which reloads the persisted state, and retries once."""

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.handle = controller_handle(config)
        self._notify_failing = False

    async def call(self, method: ControllerMethod[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """The controller's answer to `method` (a GraphController method: its signature types the
        call), within controller_timeout_s."""
        return await self.call_within(self.config.controller_timeout_s, method, *args, **kwargs)

    async def call_within(
        self, timeout_s: float, method: ControllerMethod[P, R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """`call`, bounded by timeout_s: the controller runs it only if it gets there in that time
        (`GraphController.before`), so a call this raises for never takes effect later."""
        call_id = uuid.uuid4().hex  # one id for the call and its retries: the controller runs it once
        try:
            try:
                return await self._call(timeout_s, method.__name__, args, kwargs, call_id)
            except ray.exceptions.RayActorError:
                self.handle = controller_handle(self.config)
                return await self._call(timeout_s, method.__name__, args, kwargs, call_id)
        except (TimeoutError, CallExpired, ray.exceptions.RayActorError):  # died again: restarting still
            message = f"the controller did not answer {method.__name__} within {timeout_s:g} s"
            raise ControllerUnavailable(message) from None

    async def _call(self, timeout_s: float, name: str, args: tuple, kwargs: dict, call_id: str):
        deadline = time.time() + timeout_s
        return await asyncio.wait_for(self.handle.before.remote(deadline, name, args, kwargs, call_id), timeout_s)

    def notify(
        self, method: Callable[Concatenate[GraphController, P], None], *args: P.args, **kwargs: P.kwargs
    ) -> None:
        """Fire and forget (status reports); a failure is logged once until one succeeds again."""
        getattr(self.handle, method.__name__).remote(*args, **kwargs).future().add_done_callback(self._notified)

    def _notified(self, future) -> None:
        error = future.exception()
        if error is not None and not self._notify_failing:
            log.warning("a report to the controller failed: %r", error)
        self._notify_failing = error is not None


def controller_handle(config: AppConfig):
    """The running controller, created on first use (get_if_exists makes concurrent callers agree)."""
    actor = ray.remote(GraphController).options(
        name=config.controller_name,
        namespace=config.controller_namespace,
        lifetime="detached",
        get_if_exists=True,
        # never in the placement group of whoever asks first: a TP replica's group captures the
        # actors it creates, and when that replica died the controller restarted into no group, for good
        scheduling_strategy="DEFAULT",
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
    )
    return actor.remote(config.controller_state_path, config.initial_toggles(), config.made_for())
