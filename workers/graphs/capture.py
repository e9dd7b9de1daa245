"""Capturing a ladder of buckets, largest first, into one memory pool within a memory budget: the
loop decode graphs (`graph_runner.py`) and prefill graphs (`prefill_graphs.py`) share. A bucket
that fails to capture, would pass the budget or the cap on cached graphs is recorded with its
reason and runs eager; the others are marked ready in the bucket table."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from policies.dispatch import BucketTable, FallbackReason

MB = 1 << 20


@dataclass
class BucketRecord:
    bucket: int
    capture_s: float = 0.0
    memory_mb: float = 0.0
    verify_max_abs_diff: float | None = None
    error: str | None = None


Withdraw = Callable[[int, FallbackReason, str], None]


class CapturedBuckets:
    """What a ladder of buckets captured: the table that says which bucket replays (and why the
    others do not), each bucket's record, replay and graphs; and the one way a bucket stops
    replaying, which changes them together. Decode and prefill graphs are both one of these."""

    def __init__(self, table: BucketTable) -> None:
        self.table = table
        self.records: dict[int, BucketRecord] = {}
        self._replays: dict[int, Callable] = {}
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def _withdraw(self, bucket: int, reason: FallbackReason, detail: str) -> None:
        self.table.mark_missing(bucket, reason, detail)
        self.records.setdefault(bucket, BucketRecord(bucket)).error = detail
        self._replays.pop(bucket, None)
        for g in self._graphs.pop(bucket, []):
            g.reset()

    def captured_mb(self) -> float:
        """Device memory the ready buckets' graphs took."""
        return sum(self.records[b].memory_mb for b in self.table.ready)


def captured_bytes(capture: Callable[[], None]) -> int:
    """Run a capture and return the device memory it took: the larger of what the driver and the
    allocator saw."""
    torch.cuda.synchronize()
    free_before, reserved_before = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    capture()
    torch.cuda.synchronize()
    taken_by_driver = free_before - torch.cuda.mem_get_info()[0]
    return max(0, taken_by_driver, torch.cuda.memory_reserved() - reserved_before)


def capture_ladder(
    table: BucketTable,
    records: dict[int, BucketRecord],
    capture_bucket: Callable[[int], int],
    withdraw: Withdraw,
    budget_bytes: float,
    max_graphs: int | None = None,
) -> float:
    """Capture every bucket of the table, largest first, with the garbage collector quiet;
    `capture_bucket` returns the bytes a bucket took. Returns the bytes the ready ones took."""
    used = 0.0
    gc.collect()
    torch.cuda.empty_cache()  # so memory freed by earlier graphs cannot hide what these take
    gc.disable()
    try:
        for bucket in sorted(table.buckets, reverse=True):
            record = records[bucket] = BucketRecord(bucket)
            if max_graphs is not None and len(table.ready) >= max_graphs:
                withdraw(bucket, FallbackReason.EVICTED, f"max_cached_graphs={max_graphs} reached")
                continue
            t0 = time.perf_counter()
            try:
                taken = capture_bucket(bucket)
            except Exception as e:  # a failed capture costs that bucket only
                withdraw(bucket, FallbackReason.CAPTURE_ERROR, f"{type(e).__name__}: {e}")
                continue
            record.capture_s = time.perf_counter() - t0
            record.memory_mb = taken / MB
            if used + taken > budget_bytes:
                detail = f"needs {taken / MB:.1f} MB; graph_memory_budget_mb={budget_bytes / MB:g} exceeded"
                withdraw(bucket, FallbackReason.EVICTED, detail)
                continue
            used += taken
            table.mark_ready(bucket)
    finally:
        gc.enable()
    return used


def agree_on_table(table: BucketTable, tp, device: torch.device, withdraw: Withdraw) -> None:
    """With tensor parallelism: a bucket replays only if it is ready on every rank; otherwise all
    ranks run it eager, so they always replay together. A rank where it was ready records the
    reason of a rank where it is not (the largest reason code among them, one all-reduce), with a
    detail that says it happened on another rank."""
    reasons = list(FallbackReason)
    codes = []  # per bucket: 0 if ready here, else 1 + the index of its reason
    for bucket in table.buckets:
        missing = table.missing.get(bucket, (FallbackReason.CAPTURE_ERROR, ""))
        codes.append(0 if bucket in table.ready else 1 + reasons.index(missing[0]))
    worst = torch.tensor(codes, dtype=torch.int32, device=device)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX, group=tp.group)
    for bucket, code in zip(table.buckets, worst.tolist()):
        if bucket in table.ready and code:
            reason = reasons[code - 1]
            withdraw(bucket, reason, f"{reason.value} on another tensor-parallel rank")


def any_rank(failed: bool, tp, device: torch.device) -> bool:
    """Whether this or any other tensor-parallel rank failed (one all-reduce with more than one)."""
    flag = torch.tensor([failed], dtype=torch.int32, device=device)
    if tp.world_size > 1:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=tp.group)
    return bool(flag.item())


def compare_logits(record: BucketRecord, replayed: torch.Tensor, eager: torch.Tensor) -> str | None:
    """Why a replay's output differs from eager's, or None; the largest difference goes into the
    bucket's record. Non-finite values always fail: NaN compares False with any tolerance."""
    diff = (replayed - eager).abs().max().item()
    record.verify_max_abs_diff = diff
    tolerance = 1e-2 * eager.abs().max().item()
    finite = bool(torch.isfinite(replayed).all()) and math.isfinite(diff)
    same_tokens = torch.equal(replayed.argmax(-1), eager.argmax(-1))
    if finite and same_tokens and diff <= tolerance:
        return None
    if not finite:
        return f"non-finite logits: max |graph - eager| = {diff}"
    return f"max |graph - eager| = {diff:.3g} (tolerance {tolerance:.3g}), same argmax: {same_tokens}"


def bucket_report(
    table: BucketTable, records: dict[int, BucketRecord], name: Callable[[int], str], compiled: bool
) -> dict:
    """Per-bucket capture facts, JSON-safe (served with allow_nan=False): a non-finite verify diff
    is rendered null, and that bucket's error then says non-finite."""
    out = {}
    for bucket in table.buckets:
        rec = records.get(bucket, BucketRecord(bucket))
        missing = table.missing.get(bucket)
        diff = rec.verify_max_abs_diff
        out[name(bucket)] = {
            "ready": bucket in table.ready,
            "compiled": compiled and bucket in table.ready,
            "capture_s": rec.capture_s,
            "memory_mb": rec.memory_mb,
            "verify_max_abs_diff": diff if diff is not None and math.isfinite(diff) else None,
            "fallback_reason": missing[0].value if missing else None,
            "error": rec.error or (missing[1] if missing else None),
        }
    return out
