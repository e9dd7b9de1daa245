"""A rolling swap of the model (or of the graph policy) across replicas, one stage machine in the
controller: which replicas swap now, what each reported, when the swap has succeeded or failed.

Replicas swap `max_unavailable` at a time, in the order they were READY when the swap started;
one that starts during the swap joins the end of the order, one that is gone before its turn leaves it.
Each reports its step (waiting, draining, loading, serving, reverted; loading covers load, capture
and the gate). A replica that reverts (its gate failed) fails the swap: no other replica starts,
the ones already swapped keep the new model, the rest keep the old one. A replica that does not
finish within `replica_timeout_s` fails it too. Pure: no Ray, no torch.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr


class SwapPhase(str, Enum):
    PROGRESSING = "Progressing"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


STEPS = ("waiting", "draining", "loading", "serving", "reverted")
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer path names nothing, and swaps are persisted and echoed
DONE = ("serving", "reverted")


class SwapRequest(BaseModel):
    """The body of POST /admin/model."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # 1e999 parses as inf: not a timeout

    # a checkpoint directory every replica can read (no NUL: no path holds one)
    model: StrictStr = Field(min_length=1, max_length=MAX_PATH_CHARS, pattern=r"^[^\x00]+$")
    revision: StrictStr | None = Field(None, min_length=1, max_length=128)  # a label; None: a content id
    max_unavailable: StrictInt = Field(1, ge=1)
    drain_timeout_s: StrictFloat | StrictInt = Field(30.0, gt=0)  # then running requests end with an error
    replica_timeout_s: StrictFloat | StrictInt = Field(1800.0, gt=0)


class ReplicaProgress(BaseModel):
    step: Literal["waiting", "draining", "loading", "serving", "reverted"] = "waiting"
    detail: str | None = None  # the gate's report, or why it reverted
    path: str | None = None  # in_place or rebuild
    steps: list[dict[str, Any]] = []  # {"step", "at"} for each step reached
    started_at: float | None = None
    finished_at: float | None = None


class Swap(BaseModel):
    id: str
    kind: Literal["model", "graph_policy"]
    target: dict[str, Any]  # {"model", "revision"} or {"graph_policy"}
    previous: dict[str, Any]
    actor: str
    max_unavailable: int = 1
    drain_timeout_s: float = 30.0
    replica_timeout_s: float = 1800.0
    phase: SwapPhase = SwapPhase.PROGRESSING
    reason: str | None = None
    started_at: float
    finished_at: float | None = None
    order: list[str]
    replicas: dict[str, ReplicaProgress]

    @classmethod
    def begin(
        cls,
        swap_id: str,
        kind: str,
        request: SwapRequest | None,
        target: dict,
        previous: dict,
        replicas: list[str],
        actor: str,
        now: float,
    ) -> Swap:
        settings = request.model_dump(exclude={"model", "revision"}) if request else {}
        return cls(
            id=swap_id,
            kind=kind,
            target=target,
            previous=previous,
            actor=actor,
            started_at=now,
            order=list(replicas),
            replicas={r: ReplicaProgress() for r in replicas},
            **settings,
        )

    def join(self, replica_id: str) -> None:
        """A replica that came up during the swap, still on the previous model: last in the order."""
        if self.phase == SwapPhase.PROGRESSING and replica_id not in self.replicas:
            self.order.append(replica_id)
            self.replicas[replica_id] = ReplicaProgress()

    def now_swapping(self) -> list[str]:
        """The replicas told to swap now: the first max_unavailable not yet done, while progressing."""
        if self.phase != SwapPhase.PROGRESSING:
            return []
        return [r for r in self.order if self.replicas[r].step not in DONE][: self.max_unavailable]

    def record(
        self, replica_id: str, step: str, at: float, detail: str | None = None, path: str | None = None
    ) -> str | None:
        """A replica's reported step; the reason of the transition it causes, if any."""
        progress = self.replicas.get(replica_id)
        if progress is None or self.phase != SwapPhase.PROGRESSING or progress.step == step or step not in STEPS:
            return None
        progress.step, progress.detail, progress.path = step, detail, path or progress.path
        progress.steps.append({"step": step, "at": at})
        progress.started_at = progress.started_at or at
        if step in DONE:
            progress.finished_at = at
        if step == "reverted":
            return self._finish(SwapPhase.FAILED, at, f"replica {replica_id} reverted to the previous model: {detail}")
        return self._succeed_if_done(at)

    def leave(self, replica_id: str, at: float) -> str | None:
        """A replica gone before its turn (dead, replaced): the swap goes on without it."""
        progress = self.replicas.get(replica_id)
        if self.phase != SwapPhase.PROGRESSING or progress is None or progress.step in DONE:
            return None
        self.order.remove(replica_id)
        del self.replicas[replica_id]
        return self._succeed_if_done(at)

    def _succeed_if_done(self, at: float) -> str | None:
        if self.replicas and all(p.step == "serving" for p in self.replicas.values()):
            return self._finish(SwapPhase.SUCCEEDED, at, f"{len(self.replicas)} replica(s) serving the new model")
        return None

    def check_timeouts(self, now: float) -> str | None:
        """Fail the swap if a replica told to swap has not finished within replica_timeout_s of being
        told (one that never answers, e.g. gone, included)."""
        told = max([self.started_at] + [p.finished_at for p in self.replicas.values() if p.finished_at])
        for replica_id in self.now_swapping():
            if now - (self.replicas[replica_id].started_at or told) > self.replica_timeout_s:
                return self._finish(
                    SwapPhase.FAILED,
                    now,
                    f"replica {replica_id} did not finish its swap within {self.replica_timeout_s:g} s",
                )
        return None

    def _finish(self, phase: SwapPhase, at: float, reason: str) -> str:
        self.phase, self.finished_at, self.reason = phase, at, reason
        return reason
