"""Which way each decode step runs: a replayed graph, piecewise graphs, or eager, and why.

`BucketTable` is the single source of truth for what may replay: the runner records there what it
captured and what it could not (with the reason), and every step asks it. Pure Python, so each
decision is unit-testable without a GPU.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import Enum


class ExecutionMode(str, Enum):
    CUDA_GRAPH = "cuda_graph"
    PIECEWISE = "piecewise"
    EAGER = "eager"


class FallbackReason(str, Enum):
    SHAPE_MISS = "shape_miss"
    BACKEND_UNSUPPORTED = "backend_unsupported"
    CAPTURE_ERROR = "capture_error"
    DISABLED = "disabled"
    TENANT_DISABLED = "tenant_disabled"
    ROLLOUT_HOLDBACK = "rollout_holdback"
    REBUILDING = "rebuilding"
    VERIFY_MISMATCH = "verify_mismatch"
    UNAVAILABLE = "unavailable"
    EVICTED = "evicted"


# Reasons that belong to a request (its tenant's permission), not to the step's shape.
REQUEST_REASONS = (FallbackReason.TENANT_DISABLED, FallbackReason.ROLLOUT_HOLDBACK)


def bucket_id(size: int) -> str:
    return f"decode_bs_{size}"


@dataclass(frozen=True)
class Dispatch:
    mode: ExecutionMode
    bucket: int | None  # rows the step runs with (padded size); None when eager
    reason: FallbackReason | None  # why not the policy's graph mode; None when it replays as intended
    decode_rows: bool = False  # a prefill run as rows of the decode step (`policies/cached_prefill.py`)

    @property
    def bucket_id(self) -> str:
        return bucket_id(self.bucket) if self.bucket is not None else "none"


class BucketTable:
    """Buckets of a policy and, per bucket, the mode it can replay in or the reason it cannot."""

    def __init__(self, buckets: tuple[int, ...], mode: ExecutionMode) -> None:
        self.buckets = tuple(sorted(buckets))
        self.mode = mode  # the mode graphs run in when they can (cuda_graph or piecewise)
        self.downgrade_reason: FallbackReason | None = None  # set when mode was lowered
        self.global_reason: FallbackReason | None = None  # set when nothing may replay
        self.ready: set[int] = set()
        self.missing: dict[int, tuple[FallbackReason, str]] = {}

    def mark_ready(self, bucket: int) -> None:
        self.ready.add(bucket)
        self.missing.pop(bucket, None)

    def mark_missing(self, bucket: int, reason: FallbackReason, detail: str = "") -> None:
        self.ready.discard(bucket)
        self.missing[bucket] = (reason, detail)

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest bucket >= batch_size, or None above the largest bucket."""
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[i] if i < len(self.buckets) else None

    def dispatch(self, batch_size: int) -> Dispatch:
        eager = ExecutionMode.EAGER
        if self.global_reason is not None:
            return Dispatch(eager, None, self.global_reason)
        bucket = self.padded_size(batch_size)
        if bucket is None:
            return Dispatch(eager, None, FallbackReason.SHAPE_MISS)
        if bucket not in self.ready:
            reason = self.missing.get(bucket, (FallbackReason.CAPTURE_ERROR, ""))[0]
            return Dispatch(eager, None, reason)
        return Dispatch(self.mode, bucket, self.downgrade_reason)


def split_by_permission(denials: list[FallbackReason | None]) -> tuple[list[int], dict[FallbackReason, list[int]]]:
    """Rows whose requests may use graphs, and the others grouped by their request's reason."""
    allowed: list[int] = []
    denied: dict[FallbackReason, list[int]] = {}
    for row, reason in enumerate(denials):
        if reason is None:
            allowed.append(row)
        else:
            denied.setdefault(reason, []).append(row)
    return allowed, denied


class EngineState(str, Enum):
    """MODEL_LOADED -> EAGER_WARMED -> GRAPH_CAPTURED -> READY; REBUILDING and FAILED beside."""

    MODEL_LOADED = "MODEL_LOADED"
    EAGER_WARMED = "EAGER_WARMED"
    GRAPH_CAPTURED = "GRAPH_CAPTURED"
    READY = "READY"
    REBUILDING = "REBUILDING"
    FAILED = "FAILED"
