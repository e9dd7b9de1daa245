"""Engine counters: steps, tokens, busy time, decode batch sizes, time to first token, time per
output token, prefix-cache lookups."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator

import torch

# Reasons a row of a rollout's graph cohort may still run eager; the rest are the request's own.
COHORT_EXEMPT_REASONS = ("tenant_disabled", "rollout_holdback")


def _summary(values: deque[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "mean": statistics.fmean(ordered),
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


class CallTimer:
    """Device time of the model calls of one decode step, per rollout cohort: CUDA events around each
    call (read once the step has synced), the host clock on CPU (where calls are synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._calls: list[tuple[str, int, object, object]] = []

    @contextlib.contextmanager
    def call(self, cohort: str | None, rows: int) -> Iterator[None]:
        if cohort is None:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._calls.append((cohort, rows, start, end))

    def results(self) -> list[tuple[str, int, float]]:
        """(cohort, rows, seconds) per timed call; on CUDA only after the calls' stream has synced."""
        if self.cuda:
            return [(c, n, start.elapsed_time(end) / 1e3) for c, n, start, end in self._calls]
        return [(c, n, end - start) for c, n, start, end in self._calls]


class EngineStats:
    """Updated by the engine thread, read from anywhere; recent latencies are kept in a window."""

    def __init__(self, model_revision: str = "", attention_backend: str = "", window: int = 10000) -> None:
        self._lock = threading.Lock()
        self.since = time.time()  # when these counters started: a replica carries them past a new start
        self.model_revision = model_revision
        self.attention_backend = attention_backend
        # (execution_mode, bucket_id, fallback_reason) -> [steps, rows, padding rows]
        self.step_parts: dict[tuple[str, str, str], list[int]] = {}
        # the same for prefill calls: (execution_mode, bucket_id, fallback_reason) -> [calls, tokens, padding tokens]
        self.prefill_parts: dict[tuple[str, str, str], list[int]] = {}
        self.prefill_steps = 0
        self.decode_steps = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.busy_s = {"prefill": 0.0, "decode": 0.0}  # seconds in model steps: utilization, per-step cost
        self.finished_requests: Counter[str] = Counter()
        self.batch_sizes: Counter[int] = Counter()
        self.ttft_s: deque[float] = deque(maxlen=window)
        self.tpot_s: deque[float] = deque(maxlen=window)
        self.cohort_calls: dict[tuple[str, int], list[float]] = {}  # (cohort, rows) -> [calls, seconds]
        self.adapter_loads: Counter[str] = Counter()  # "loaded" | "refused" -> adapter loads
        self.adapter_load_s = 0.0  # seconds copying adapters into slots, all loads
        self.adapter_tokens: Counter[str] = Counter()  # adapter name -> tokens generated with it
        self.prefix_queries_tokens = 0  # tokens of prefilled sequences looked up in the prefix cache
        self.prefix_hits_tokens = 0  # ... and found there (not computed)

    def record_prefill(
        self, num_prompts: int, num_tokens: int, mode: str, bucket_id: str, reason: str, padding: int
    ) -> None:
        """One prefill call: the prompts it finished (each drew its first token), its tokens, how it
        ran (replayed prefill graphs of a bucket, or eager and why) and its padding tokens."""
        with self._lock:
            self.prefill_steps += 1
            self.prompt_tokens += num_tokens
            self.generated_tokens += num_prompts
            counts = self.prefill_parts.setdefault((mode, bucket_id, reason), [0, 0, 0])
            counts[0] += 1
            counts[1] += num_tokens
            counts[2] += padding

    def record_prefix_cache(self, queried: int, hit: int) -> None:
        """One prefill's prefix-cache lookups: hit / queried is the hit rate (vLLM counts alike)."""
        with self._lock:
            self.prefix_queries_tokens += queried
            self.prefix_hits_tokens += hit

    def record_decode(self, batch_size: int) -> None:
        with self._lock:
            self.decode_steps += 1
            self.generated_tokens += batch_size
            self.batch_sizes[batch_size] += 1

    def record_busy(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.busy_s[phase] += seconds

    def record_step(self, mode: str, bucket_id: str, reason: str, rows: int, padding: int) -> None:
        """One model call of a decode step (a split step makes two: graph rows and eager rows)."""
        with self._lock:
            counts = self.step_parts.setdefault((mode, bucket_id, reason), [0, 0, 0])
            counts[0] += 1
            counts[1] += rows
            counts[2] += padding

    def record_adapter_load(self, result: str, seconds: float) -> None:
        with self._lock:
            self.adapter_loads[result] += 1
            self.adapter_load_s += seconds

    def record_adapter_tokens(self, tokens: Counter[str]) -> None:
        with self._lock:
            self.adapter_tokens.update(tokens)

    def record_cohort_call(self, cohort: str, rows: int, seconds: float) -> None:
        """One decode model call of a rollout cohort ("graph": rows allowed graphs; "holdback": rows
        the rollout holds back) and its device time: the rollout's TPOT guard compares the two at
        equal batch sizes."""
        with self._lock:
            counts = self.cohort_calls.setdefault((cohort, rows), [0, 0.0])
            counts[0] += 1
            counts[1] += seconds

    def cohorts(self) -> dict[str, dict]:
        """Per rollout cohort: decode rows, rows that ran eager anyway (graph cohort) and calls by
        batch size ({rows: [calls, seconds]})."""
        out = {c: {"rows": 0, "fallback_rows": 0, "calls": {}} for c in ("graph", "holdback")}
        for (mode, _, reason), counts in self.step_parts.items():
            if reason == "rollout_holdback":
                out["holdback"]["rows"] += counts[1]
            elif reason not in COHORT_EXEMPT_REASONS:
                out["graph"]["rows"] += counts[1]
                if mode == "eager":
                    out["graph"]["fallback_rows"] += counts[1]
        for (cohort, rows), (calls, seconds) in sorted(self.cohort_calls.items()):
            out[cohort]["calls"][rows] = [calls, seconds]
        return out

    def record_finish(self, reason: str, ttft: float | None, tpot: float | None) -> None:
        with self._lock:
            self.finished_requests[reason] += 1
            if ttft is not None:
                self.ttft_s.append(ttft)
            if tpot is not None:
                self.tpot_s.append(tpot)

    def graph_summary(self) -> dict:
        """Graph hit rate and fallback rate by reason (over decoded rows), padding waste (padding
        rows over all rows replayed), and how many steps each bucket served."""
        rows = sum(c[1] for c in self.step_parts.values()) or 1
        graph = [(k, c) for k, c in self.step_parts.items() if k[0] != "eager"]
        replayed = sum(c[1] + c[2] for _, c in graph)
        by_reason: dict[str, int] = {}
        by_bucket: dict[str, int] = {}
        for (_, bucket, reason), c in self.step_parts.items():
            if reason != "none":
                by_reason[reason] = by_reason.get(reason, 0) + c[1]
            by_bucket[bucket] = by_bucket.get(bucket, 0) + c[0]
        return {
            "graph_hit_rate": sum(c[1] for _, c in graph) / rows,
            "fallback_rate": {r: n / rows for r, n in sorted(by_reason.items())},
            "padding_waste": sum(c[2] for _, c in graph) / replayed if replayed else 0.0,
            "steps_by_bucket": dict(sorted(by_bucket.items())),
            "decode_step_parts": self._parts(self.step_parts, ("steps", "rows", "padding_rows")),
        }

    def _parts(self, parts: dict[tuple[str, str, str], list[int]], counts: tuple[str, ...]) -> list[dict]:
        """Model calls by (execution_mode, bucket_id, fallback_reason), with the step labels and
        `counts` named."""
        return [
            {
                "execution_mode": m,
                "bucket_id": b,
                "fallback_reason": r,
                "model_revision": self.model_revision,
                "attention_backend": self.attention_backend,
                **dict(zip(counts, c)),
            }
            for (m, b, r), c in sorted(parts.items())
        ]

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "since": self.since,
                **self.graph_summary(),
                "prefill_steps": self.prefill_steps,
                "prefill_step_parts": self._parts(self.prefill_parts, ("steps", "tokens", "padding_tokens")),
                "decode_steps": self.decode_steps,
                "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens,
                "busy_s": dict(self.busy_s),
                "finished_requests": dict(self.finished_requests),
                "decode_batch_sizes": dict(sorted(self.batch_sizes.items())),
                "ttft_s": _summary(self.ttft_s),
                "tpot_s": _summary(self.tpot_s),
                "cohorts": self.cohorts(),
                "prefix_cache": {"queries_tokens": self.prefix_queries_tokens, "hits_tokens": self.prefix_hits_tokens},
                "lora": {
                    "loads": dict(self.adapter_loads),
                    "load_s": self.adapter_load_s,
                    "generated_tokens": dict(self.adapter_tokens),
                },
            }
