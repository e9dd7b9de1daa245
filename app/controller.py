"""The controller actor: owner of per-tenant graph toggles, their audit log, and the latest status
each replica reported.

Named and detached in an explicit namespace, restarted by Ray if it dies. Toggles and the audit log
are written atomically (temp file + rename) on every change and read back when the actor starts, so
a restart loses nothing. A change is persisted before it is applied: a write that fails changes
nothing and the caller gets an error. A state file that cannot be used (not JSON, or JSON
of another shape) is renamed aside to `<name>.corrupt-<UTC time>` and the actor starts from the
config's toggles, logging why: it never fails to start over its file (with unlimited restarts that
would be a crash loop). Replicas poll `get_toggles()` (a cheap version check) and push their
status; the ingress reads statuses for /admin/status, /readyz and /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from app.config import AppConfig

log = logging.getLogger(__name__)

AUDIT_KEEP = 1000
STALE_AFTER_S = 10.0


class _AuditEntry(BaseModel):
    model_config = ConfigDict(extra="allow")
    time: StrictFloat
    actor: StrictStr
    tenant: StrictStr
    action: StrictStr
    before: StrictBool
    after: StrictBool


class _State(BaseModel):
    """The shape of the state file (what `_write_state` writes)."""

    toggles: dict[str, StrictBool]
    audit: list[_AuditEntry]
    version: StrictInt = Field(ge=0)


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
        log.error("controller state %s is %s and could not be renamed aside (%s); starting from the config's "
                  "toggles", path, reason, e)  # fmt: skip
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
    def __init__(self, state_path: str, initial_toggles: dict[str, bool]) -> None:
        self.path = Path(state_path)
        self.toggles = dict(initial_toggles)
        self.audit: list[dict] = []
        self.version = 0
        self.replicas: dict[str, dict] = {}
        state = _read_state(self.path)
        if state is not None:
            self.toggles.update(state["toggles"])
            self.audit = state["audit"][-AUDIT_KEEP:]
            self.version = state["version"]

    def get_toggles(self, known_version: int = -1) -> tuple[int, dict[str, bool] | None]:
        """(version, toggles); toggles is None when the caller already has this version."""
        return self.version, (None if known_version == self.version else dict(self.toggles))

    def tenant(self, tenant: str) -> dict:
        last = next((a for a in reversed(self.audit) if a["tenant"] == tenant), None)
        return {
            "tenant": tenant,
            "cuda_graph": self.toggles.get(tenant, True),
            "updated_at": last["time"] if last else None,
            "updated_by": last["actor"] if last else None,
        }

    def set_toggle(self, tenant: str, enabled: bool, actor: str, client: str | None = None) -> dict:
        """Set a tenant's graph permission: the new state is written first and only then applied; a
        failed write leaves toggles, version and audit as they were and returns {"error": why}. A set
        that changes nothing returns the current state without an audit entry or a version bump: a
        call Ray retries after a restart (max_task_retries=-1) that had already been persisted is then
        a no-op instead of a second audit entry."""
        before = self.toggles.get(tenant, True)
        if before == enabled:
            return self.tenant(tenant)
        entry = {"time": time.time(), "actor": actor, "client": client, "tenant": tenant,
                 "action": "set_cuda_graph", "before": before, "after": enabled}  # fmt: skip
        toggles, audit, version = (
            {**self.toggles, tenant: enabled},
            [*self.audit, entry][-AUDIT_KEEP:],
            self.version + 1,
        )
        try:
            _write_state(self.path, {"toggles": toggles, "audit": audit, "version": version})
        except OSError as e:
            log.error("controller state %s could not be written (%s); toggle of %s not changed", self.path, e, tenant)
            return {"error": f"the toggle was not changed: the controller could not write its state file "
                             f"{self.path} ({e.strerror or e})"}  # fmt: skip
        self.toggles, self.audit, self.version = toggles, audit, version
        return self.tenant(tenant)

    def audit_log(self, limit: int = 100) -> list[dict]:
        return self.audit[-limit:]

    def report(self, replica_id: str, status: dict) -> None:
        self.replicas[replica_id] = {**status, "reported_at": time.time()}

    def replica_statuses(self) -> dict[str, dict]:
        now = time.time()
        return {rid: s for rid, s in self.replicas.items() if now - s["reported_at"] < STALE_AFTER_S}


class ControllerUnavailable(RuntimeError):
    """The controller did not answer a call within controller_timeout_s."""


class ControllerClient:
    """Calls the controller, each call bounded by `controller_timeout_s` (a restarting actor holds
    calls until it is back); if the actor is gone for good (killed without restart), creates it
    again, which reloads the persisted state, and retries once."""

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.handle = controller_handle(config)
        self._notify_failing = False

    async def call(self, method: str, *args):
        try:
            try:
                return await asyncio.wait_for(self._call(method, *args), self.config.controller_timeout_s)
            except ray.exceptions.RayActorError:
                self.handle = controller_handle(self.config)
                return await asyncio.wait_for(self._call(method, *args), self.config.controller_timeout_s)
        except TimeoutError:
            raise ControllerUnavailable(
                f"the controller did not answer {method} within {self.config.controller_timeout_s:g} s"
            ) from None

    async def _call(self, method: str, *args):
        return await getattr(self.handle, method).remote(*args)

    def notify(self, method: str, *args) -> None:
        """Fire and forget (status reports); a failure is logged once until one succeeds again."""
        getattr(self.handle, method).remote(*args).future().add_done_callback(self._notified)

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
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
    )
    return actor.remote(config.controller_state_path, config.initial_toggles())
