"""Metrics: counted in each replica, reported to the controller with the replica's status, rendered
as one Prometheus exposition by the ingress's /metrics.

Every series carries a `replica` label, so counters from many processes add up correctly in
Prometheus (a restarted replica is a new series) and one scrape target sees the whole application.
"""

from __future__ import annotations

import bisect
import copy

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


ANY = "*"  # every key of a dict at this point of a counter's path
EACH = "#"  # every item of a list of numbers ([calls, seconds])

# Where a replica's status holds engine counters: paths of keys, where ANY and EACH stand for every
# key or item there and a tuple of label names for a list of entries, each entry a series named by
# those labels. Every counter the engine starts again from zero on a restart is here (the rollout's
# stage signals and /admin/status read them, as well as /metrics); rates and summaries since the
# engine's start are not.
COUNTER_PATHS = (
    *(("stats", name) for name in ("prefill_steps", "decode_steps", "prompt_tokens", "generated_tokens")),
    *(("stats", name, ANY) for name in ("busy_s", "finished_requests", "decode_batch_sizes", "steps_by_bucket")),
    ("stats", "prefix_cache", ANY),
    ("stats", "lora", "loads", ANY),
    ("stats", "lora", "generated_tokens", ANY),
    ("stats", "lora", "load_s"),
    ("stats", "cohorts", ANY, "rows"),
    ("stats", "cohorts", ANY, "fallback_rows"),
    ("stats", "cohorts", ANY, "calls", ANY, EACH),  # {rows: [calls, seconds]}
    ("stats", "shadow", "checks"),
    ("stats", "shadow", "mismatches"),
    ("stats", "shadow", "by_bucket", ("bucket_id", "result"), "count"),
    *(("stats", "prefill_step_parts", STEP_LABELS, v) for v in ("steps", "tokens", "padding_tokens")),
    *(("stats", "decode_step_parts", STEP_LABELS, v) for v in ("steps", "rows", "padding_rows")),
    ("kv_cache", "preemptions"),
)


class CarriedCounters:
    """A replica's engine counters, never going down. The engine starts them from zero when it
    restarts in place (a crash), a swap's gate runs, or a rebuild starts a new engine process, and
    the replica label stays: its series dropped and, until a label set saw its first step again,
    vanished. The engine's stats say when they started (`since`): when that changes, what every
    series had is carried, added from then on. The KV pool's preemptions restart with the engine
    process, not with a gate: a drop of that series is taken as its restart (Prometheus' reading)."""

    def __init__(self) -> None:
        self.base: dict[tuple, float] = {}
        self.last: dict[tuple, float] = {}
        self.since: float | None = None

    def apply(self, status: dict) -> dict:
        """The status with its engine counters carried across the engine's restarts."""
        raw = dict(_series(status))
        since = status.get("stats", {}).get("since")
        for key, value in self.last.items():
            if COUNTER_PATHS[key[0]][0] != "stats":
                carry = key not in raw or raw[key] < value
            elif since is None:  # no engine stats in this status: what they had stays last
                raw.setdefault(key, value)
                carry = False
            else:  # new stats: every series the old ones had, those the new ones lack and zeros included
                carry = since != self.since
            if carry:
                self.base[key] = self.base.get(key, 0) + value
        self.since = since or self.since
        self.last = raw
        if not self.base:
            return status
        out = copy.deepcopy(status)
        for key in sorted(raw.keys() | self.base.keys(), key=str):
            _put(out, COUNTER_PATHS[key[0]], key[1:], raw.get(key, 0) + self.base.get(key, 0))
        return out


def _series(status: dict):
    """(key, value) of every counter in the status: a key is (its path's index, the keys taken),
    where an entry of a labelled list is taken as its labels' (name, value) pairs."""
    for index, path in enumerate(COUNTER_PATHS):
        for keys, value in _walk(status, path):
            yield (index, *keys), value


def _walk(node, path: tuple):
    if not path:
        if isinstance(node, int | float) and not isinstance(node, bool):
            yield (), node
        return
    step, rest = path[0], path[1:]
    if isinstance(step, tuple):
        children = [(_labels(e, step), e) for e in node if isinstance(e, dict)] if isinstance(node, list) else []
    elif step == EACH:
        children = list(enumerate(node)) if isinstance(node, list) else []
    elif not isinstance(node, dict):
        children = []
    else:
        children = list(node.items()) if step == ANY else [(step, node[step])] if step in node else []
    for key, child in children:
        for keys, value in _walk(child, rest):
            yield (key, *keys), value


def _labels(entry: dict, names: tuple[str, ...]) -> tuple:
    return tuple((name, entry.get(name)) for name in names)


def _put(node, path: tuple, keys: tuple, total: float) -> None:
    """Set the counter at `keys` (taken along `path`) to `total`, making what the status lacks on
    the way (a series the restarted engine has not counted yet): dicts, list items and labelled
    entries, those in the labels' order."""
    for i, (step, key) in enumerate(zip(path, keys, strict=True)):
        last = i == len(path) - 1
        if isinstance(step, tuple):
            entry = next((e for e in node if _labels(e, step) == key), None)
            if entry is None:
                entry = dict(key)
                node.append(entry)
                node.sort(key=lambda e: str(_labels(e, step)))
            node = entry
            continue
        if step == EACH:
            node.extend([0] * (key + 1 - len(node)))
        if last:
            node[key] = total
        elif step == EACH:
            node = node[key]
        else:
            following = path[i + 1]
            node = node.setdefault(key, [] if following == EACH or isinstance(following, tuple) else {})


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
