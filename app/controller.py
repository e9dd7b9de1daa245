"""The controller actor: owner of per-tenant graph toggles, their audit log, and the latest status
each replica reported.

Named and detached in an explicit namespace, restarted by Ray if it dies. Toggles and the audit log
are written atomically (temp file + rename) on every change and read back when the actor starts, so
a restart loses nothing. Replicas poll `toggles()` (a cheap version check) and push their status;
the ingress reads statuses for /admin/status, /readyz and /metrics.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import ray

from app.config import AppConfig

AUDIT_KEEP = 1000
STALE_AFTER_S = 10.0


class GraphController:
    def __init__(self, state_path: str, initial_toggles: dict[str, bool]) -> None:
        self.path = Path(state_path)
        self.toggles = dict(initial_toggles)
        self.audit: list[dict] = []
        self.version = 0
        self.replicas: dict[str, dict] = {}
        if self.path.is_file():
            state = json.loads(self.path.read_text())
            self.toggles.update(state.get("toggles", {}))
            self.audit = state.get("audit", [])
            self.version = state.get("version", 0)

    def _persist(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
        with os.fdopen(fd, "w") as f:
            json.dump({"toggles": self.toggles, "audit": self.audit[-AUDIT_KEEP:], "version": self.version}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

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

    def set_toggle(self, tenant: str, enabled: bool, actor: str) -> dict:
        before = self.toggles.get(tenant, True)
        self.toggles[tenant] = enabled
        self.version += 1
        self.audit.append({"time": time.time(), "actor": actor, "tenant": tenant, "action": "set_cuda_graph",
                           "before": before, "after": enabled})  # fmt: skip
        self._persist()
        return self.tenant(tenant)

    def audit_log(self, limit: int = 100) -> list[dict]:
        return self.audit[-limit:]

    def report(self, replica_id: str, status: dict) -> None:
        self.replicas[replica_id] = {**status, "reported_at": time.time()}

    def replica_statuses(self) -> dict[str, dict]:
        now = time.time()
        return {rid: s for rid, s in self.replicas.items() if now - s["reported_at"] < STALE_AFTER_S}


class ControllerClient:
    """Calls the controller; if the actor is gone for good (killed without restart), creates it
    again, which reloads the persisted state, and retries once."""

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.handle = controller_handle(config)

    async def call(self, method: str, *args):
        try:
            return await getattr(self.handle, method).remote(*args)
        except ray.exceptions.RayActorError:
            self.handle = controller_handle(self.config)
            return await getattr(self.handle, method).remote(*args)

    def notify(self, method: str, *args) -> None:
        """Fire and forget (status reports)."""
        getattr(self.handle, method).remote(*args)


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
