"""Metrics: counted in each replica, reported to the controller with the replica's status, rendered
as one Prometheus exposition by the ingress's /metrics.

Every series carries a `replica` label, so counters from many processes add up correctly in
Prometheus (a restarted replica is a new series) and one scrape target sees the whole application.
"""

from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
STEP_LABELS = ("execution_mode", "bucket_id", "fallback_reason", "model_revision", "attention_backend")


class Histogram:
    """Cumulative-on-render bucket counts; plain data so it travels in a status report."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, value)] += 1
        self.sum += value

    def as_dict(self) -> dict:
        return {"counts": list(self.counts), "sum": self.sum}


ERROR_OUTCOMES = ("error", "engine_failed")  # what a rollout's error-rate guard counts as errors


class RequestMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        self.cohorts = {c: {"requests": 0, "errors": 0} for c in ("graph", "holdback")}
        self.ttft = Histogram()
        self.tpot = Histogram()

    def count(self, tenant: str, outcome: str, cohort: str | None = None) -> None:
        """One finished request; `cohort` is the rollout cohort it ran in ("graph", "holdback")."""
        self.requests[(tenant, outcome)] = self.requests.get((tenant, outcome), 0) + 1
        if cohort is not None:
            self.cohorts[cohort]["requests"] += 1
            self.cohorts[cohort]["errors"] += outcome in ERROR_OUTCOMES

    def as_dict(self) -> dict:
        return {
            "requests": [{"tenant": t, "outcome": o, "count": n} for (t, o), n in sorted(self.requests.items())],
            "cohorts": {c: dict(v) for c, v in self.cohorts.items()},
            "ttft_s": self.ttft.as_dict(),
            "tpot_s": self.tpot.as_dict(),
        }


# Engine counters in a replica's status: (where, the labels that name a series, its values)
PART_COUNTERS = (
    ("prefill_step_parts", STEP_LABELS, ("steps", "tokens", "padding_tokens")),
    ("decode_step_parts", STEP_LABELS, ("steps", "rows", "padding_rows")),
)
NAMED_COUNTERS = (("busy_s",), ("lora", "loads"), ("lora", "generated_tokens"), ("prefix_cache",))


class CarriedCounters:
    """A replica's engine counters, never going down. The engine starts them from zero when it
    restarts in place (a crash), a swap's gate runs, or a rebuild starts a new engine process, and
    the replica label stays: its series dropped and, until a label set saw its first step again,
    vanished. Each series that drops is taken as restarted (Prometheus' own reading of a drop) and
    what it had is carried, added from then on; a restart the next report finds already past its
    old total is not seen, as Prometheus would not see it."""

    def __init__(self) -> None:
        self.base: dict[tuple, float] = {}
        self.last: dict[tuple, float] = {}

    def apply(self, status: dict) -> dict:
        """The status with its engine counters carried across the engine's restarts."""
        raw = dict(_counter_series(status))
        for key, value in self.last.items():
            if raw.get(key, 0) < value:
                self.base[key] = self.base.get(key, 0) + value
        self.last = raw
        return _with_series(status, {k: raw.get(k, 0) + self.base.get(k, 0) for k in raw.keys() | self.base.keys()})


def _counter_series(status: dict):
    stats = status.get("stats", {})
    for where, labels, values in PART_COUNTERS:
        for part in stats.get(where, []):
            for value in values:
                yield (where, tuple(part[k] for k in labels), value), part[value]
    for path in NAMED_COUNTERS:
        named = stats
        for step in path:
            named = named.get(step, {})
        for name, value in named.items():
            yield (*path, name), value
    for check in stats.get("shadow", {}).get("by_bucket", []):
        yield ("shadow", check["bucket_id"], check["result"]), check["count"]
    if status.get("kv_cache"):
        yield ("kv_cache", "preemptions"), status["kv_cache"]["preemptions"]


def _with_series(status: dict, totals: dict[tuple, float]) -> dict:
    if "stats" not in status:
        return status
    stats = dict(status["stats"])
    if "lora" in stats:
        stats["lora"] = dict(stats["lora"])
    out = {**status, "stats": stats}
    for where, labels, values in PART_COUNTERS:
        parts: dict[tuple, dict] = {}
        for (kind, *rest), total in totals.items():
            if kind == where:
                key, value = rest
                parts.setdefault(key, dict(zip(labels, key, strict=True)) | dict.fromkeys(values, 0))[value] = total
        stats[where] = [parts[k] for k in sorted(parts, key=str)]
    for path in NAMED_COUNTERS:
        parent = stats.get("lora", {}) if path[0] == "lora" else stats
        if path[-1] in parent:
            parent[path[-1]] = {key[-1]: total for key, total in totals.items() if key[:-1] == path}
    if "shadow" in stats:
        checks = [{"bucket_id": k[1], "result": k[2], "count": n} for k, n in totals.items() if k[0] == "shadow"]
        stats["shadow"] = {**stats["shadow"], "by_bucket": sorted(checks, key=lambda c: (c["bucket_id"], c["result"]))}
    if ("kv_cache", "preemptions") in totals:
        out["kv_cache"] = {**status["kv_cache"], "preemptions": totals[("kv_cache", "preemptions")]}
    return out


def _histogram(name: str, doc: str, per_replica: dict[str, dict]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["replica"])
    for replica, h in per_replica.items():
        cumulative, buckets = 0, []
        for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), h["counts"]):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        family.add_metric([replica], buckets, h["sum"])
    return family


class _StatusCollector:
    def __init__(self, statuses: dict[str, dict]) -> None:
        self.statuses = statuses

    def collect(self):
        steps = CounterMetricFamily(
            "graphserve_decode_steps", "Decode step model calls", labels=[*STEP_LABELS, "replica"]
        )
        rows = CounterMetricFamily("graphserve_decode_rows", "Sequences decoded", labels=[*STEP_LABELS, "replica"])
        padding = CounterMetricFamily(
            "graphserve_decode_padding_rows", "Padding rows replayed", labels=[*STEP_LABELS, "replica"]
        )
        prefill_steps = CounterMetricFamily(
            "graphserve_prefill_steps", "Prefill model calls", labels=[*STEP_LABELS, "replica"]
        )
        prefill_tokens = CounterMetricFamily(
            "graphserve_prefill_tokens", "Prompt tokens prefilled", labels=[*STEP_LABELS, "replica"]
        )
        prefill_padding = CounterMetricFamily(
            "graphserve_prefill_padding_tokens",
            "Padding tokens replayed by prefill graphs",
            labels=[*STEP_LABELS, "replica"],
        )
        requests = CounterMetricFamily(
            "graphserve_requests", "Requests by tenant and outcome", labels=["tenant", "outcome", "replica"]
        )
        ready = GaugeMetricFamily(
            "graphserve_replica_ready", "1 when the replica's engine is READY", labels=["replica"]
        )
        captured = GaugeMetricFamily(
            "graphserve_graph_buckets_captured", "Decode buckets replaying", labels=["replica"]
        )
        prefill_captured = GaugeMetricFamily(
            "graphserve_prefill_buckets_captured", "Prefill buckets (of token counts) replaying", labels=["replica"]
        )
        busy = CounterMetricFamily(
            "graphserve_engine_busy_seconds", "Seconds the engine spent in model steps", labels=["phase", "replica"]
        )
        pages = GaugeMetricFamily("graphserve_kv_pages", "Pages of the KV pool", labels=["replica"])
        free = GaugeMetricFamily("graphserve_kv_pages_free", "Pages of the KV pool not held", labels=["replica"])
        preempted = CounterMetricFamily(
            "graphserve_preemptions", "Sequences preempted for KV pages", labels=["replica"]
        )
        shadow = CounterMetricFamily(
            "graphserve_shadow_verifications",
            "Replayed steps recomputed eagerly and compared",
            labels=["result", "bucket_id", "replica"],
        )
        yield from self._lora()
        yield from self._prefix_cache()
        for replica, status in self.statuses.items():
            for check in status.get("stats", {}).get("shadow", {}).get("by_bucket", []):
                shadow.add_metric([check["result"], check["bucket_id"], replica], check["count"])
            kv = status.get("kv_cache")
            if kv:
                pages.add_metric([replica], kv["pages"])
                free.add_metric([replica], kv["pages_free"])
                preempted.add_metric([replica], kv["preemptions"])
            ready.add_metric([replica], 1.0 if status.get("state") == "READY" else 0.0)
            captured.add_metric([replica], sum(1 for b in status.get("buckets", {}).values() if b["ready"]))
            prefill_buckets = status.get("prefill_buckets", {}).values()
            prefill_captured.add_metric([replica], sum(1 for b in prefill_buckets if b["ready"]))
            for part in status.get("stats", {}).get("prefill_step_parts", []):
                labels = [str(part[k]) for k in STEP_LABELS] + [replica]
                prefill_steps.add_metric(labels, part["steps"])
                prefill_tokens.add_metric(labels, part["tokens"])
                prefill_padding.add_metric(labels, part["padding_tokens"])
            for part in status.get("stats", {}).get("decode_step_parts", []):
                labels = [str(part[k]) for k in STEP_LABELS] + [replica]
                steps.add_metric(labels, part["steps"])
                rows.add_metric(labels, part["rows"])
                padding.add_metric(labels, part["padding_rows"])
            for r in status.get("requests", {}).get("requests", []):
                requests.add_metric([r["tenant"], r["outcome"], replica], r["count"])
            for phase, seconds in status.get("stats", {}).get("busy_s", {}).items():
                busy.add_metric([phase, replica], seconds)
        yield from (steps, rows, padding, requests, ready, captured, busy, pages, free, preempted, shadow)
        yield from (prefill_steps, prefill_tokens, prefill_padding, prefill_captured)
        with_requests = {r: s["requests"] for r, s in self.statuses.items() if "requests" in s}
        yield _histogram(
            "graphserve_ttft_seconds", "Time to first token", {r: v["ttft_s"] for r, v in with_requests.items()}
        )
        yield _histogram(
            "graphserve_tpot_seconds", "Time per output token", {r: v["tpot_s"] for r, v in with_requests.items()}
        )

    def _prefix_cache(self):
        """Hit rate inputs (hits / queries, over any window) and the pages a new prompt may reuse."""
        queries = CounterMetricFamily(
            "graphserve_prefix_cache_queries_tokens",
            "Tokens of prefilled sequences looked up in the prefix cache",
            labels=["replica"],
        )
        hits = CounterMetricFamily(
            "graphserve_prefix_cache_hits_tokens",
            "Tokens found in the prefix cache (their KV reused, not computed)",
            labels=["replica"],
        )
        cached = GaugeMetricFamily(
            "graphserve_kv_pages_cached", "KV pages holding a cached prefix (held or idle)", labels=["replica"]
        )
        for replica, status in self.statuses.items():
            lookups = status.get("stats", {}).get("prefix_cache")
            if lookups is not None:
                queries.add_metric([replica], lookups["queries_tokens"])
                hits.add_metric([replica], lookups["hits_tokens"])
            kv = status.get("kv_cache") or {}
            if "pages_cached" in kv:
                cached.add_metric([replica], kv["pages_cached"])
        yield from (queries, hits, cached)

    def _lora(self):
        """Adapters per replica. The `adapter` label takes only names an operator registered (a
        request naming another is refused before it reaches a replica), so it stays bounded."""
        slots = GaugeMetricFamily("graphserve_lora_adapters_loaded", "Adapters held in LoRA slots", labels=["replica"])
        loads = CounterMetricFamily(
            "graphserve_lora_adapter_loads", "Adapters loaded into a slot, or refused", labels=["result", "replica"]
        )
        tokens = CounterMetricFamily(
            "graphserve_lora_generated_tokens", "Tokens generated with an adapter", labels=["adapter", "replica"]
        )
        for replica, status in self.statuses.items():
            lora, stats = status.get("lora"), status.get("stats", {}).get("lora", {})
            if lora is None:
                continue
            slots.add_metric([replica], len(lora.get("adapters", {})))
            for result, n in stats.get("loads", {}).items():
                loads.add_metric([result, replica], n)
            for name, n in stats.get("generated_tokens", {}).items():
                tokens.add_metric([name, replica], n)
        yield from (slots, loads, tokens)


class _RolloutCollector:
    PHASES = ("Progressing", "Paused", "Succeeded", "RolledBack", "Aborted")

    def __init__(self, rollout: dict | None) -> None:
        self.rollout = rollout

    def collect(self):
        r = self.rollout
        percent = GaugeMetricFamily(
            "graphserve_rollout_percent", "Share of traffic in the graph cohort (100 with no rollout)"
        )
        percent.add_metric([], 100.0 if r is None else r["percent"])
        phase = GaugeMetricFamily("graphserve_rollout_phase", "1 for the current rollout's phase", labels=["phase"])
        failures = CounterMetricFamily(
            "graphserve_rollout_guard_failures", "Failed guard evaluations of the current rollout", labels=["guard"]
        )
        if r is not None:
            for name in self.PHASES:
                phase.add_metric([name], 1.0 if r["phase"] == name else 0.0)
            for guard, n in r["guard_failures"].items():
                failures.add_metric([guard], n)
        yield from (percent, phase, failures)


def render(statuses: dict[str, dict], rollout: dict | None = None) -> bytes:
    registry = CollectorRegistry()
    registry.register(_StatusCollector(statuses))
    registry.register(_RolloutCollector(rollout))
    return generate_latest(registry)
