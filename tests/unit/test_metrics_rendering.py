"""/metrics for the rollout and shadow verification: the series docs/metrics.md names, from the payloads
replicas and the controller really produce."""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from app.auth import Operator
from app.controller import GraphController, signals_from_statuses
from app.metrics import CarriedCounters, render
from workers.serving.stats import EngineStats


def families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def test_shadow_verifications_and_rollout_series(tmp_path):
    status = {
        "state": "READY",
        "stats": {
            "shadow": {
                "by_bucket": [
                    {"bucket_id": "decode_bs_8", "result": "match", "count": 41},
                    {"bucket_id": "decode_bs_8", "result": "mismatch", "count": 1},
                ]
            }
        },
    }
    c = GraphController(str(tmp_path / "state.json"), {})
    c.start_rollout(
        {"steps": [{"percent": 5, "hold_s": 60}, {"percent": 100}], "guards": {"failure_limit": 1}}, Operator("a")
    )
    c.rollout.guard_failures["tpot"] = 2
    got = families(render({"r1": status}, c.current_rollout()))
    shadow = {
        (s.labels["result"], s.labels["bucket_id"], s.labels["replica"]): s.value
        for s in got["graphserve_shadow_verifications"].samples
        if s.name.endswith("_total")
    }
    assert shadow == {("match", "decode_bs_8", "r1"): 41, ("mismatch", "decode_bs_8", "r1"): 1}
    assert [s.value for s in got["graphserve_rollout_percent"].samples] == [5.0]
    phases = {s.labels["phase"]: s.value for s in got["graphserve_rollout_phase"].samples}
    assert phases["Progressing"] == 1.0 and sum(phases.values()) == 1.0
    (tpot,) = [s for s in got["graphserve_rollout_guard_failures"].samples if s.name.endswith("_total")]
    assert (tpot.labels, tpot.value) == ({"guard": "tpot"}, 2.0)
    assert [s.value for s in families(render({}, None))["graphserve_rollout_percent"].samples] == [100.0]


def engine_status(stats: EngineStats, shadow: list[dict], preemptions: int) -> dict:
    """A replica's status as it holds the engine's (`EngineStatus.as_dict`'s stats and kv_cache)."""
    kv = {"page_size": 16, "pages": 100, "pages_free": 90, "pages_cached": 3, "max_num_seqs": 8}
    return {
        "state": "READY",
        "stats": {**stats.snapshot(), "shadow": {"mismatches": 0, "by_bucket": shadow}},
        "kv_cache": {**kv, "preemptions": preemptions},
        "lora": {"adapters": {}},
    }


def counters(text: bytes) -> dict[tuple, float]:
    return {
        (s.name, *sorted(s.labels.items())): s.value
        for f in families(text).values()
        if f.type == "counter"
        for s in f.samples
        if s.name.endswith("_total")
    }


def test_engine_counters_never_go_down_across_an_engine_restart():
    """A swap's gate, a rebuild and an engine crash start the engine's counters from zero while the
    replica (its `replica` label) stays: busy seconds went 5.2 -> 0, the prefix-cache counters and
    adapter loads dropped, and step series vanished until their labels stepped again. Carried, every
    counter series keeps its total and grows from there."""
    before = EngineStats("rev1", "sdpa")
    before.record_step("graph", "decode_bs_8", "none", rows=6, padding=2)
    before.record_busy("decode", 5.2)
    before.record_prefix_cache(76, 16)
    before.record_adapter_load("refused", 0.0)
    before.record_adapter_tokens(Counter({"sql": 40}))
    before.record_prefill(2, 30, "eager", "prefill_eager", "none", 0)
    shadow = [{"bucket_id": "decode_bs_8", "result": "match", "count": 41}]
    carried = CarriedCounters()
    first = counters(render({"r1": carried.apply(engine_status(before, shadow, preemptions=3))}))

    after = EngineStats("rev1", "sdpa")  # the restarted engine: one decode step of another bucket so far
    after.record_step("graph", "decode_bs_1", "none", rows=1, padding=0)
    after.record_busy("decode", 0.5)
    after.record_prefix_cache(4, 0)
    second = counters(render({"r1": carried.apply(engine_status(after, [], preemptions=0))}))
    assert set(first) <= set(second)
    assert all(second[k] >= v for k, v in first.items()), {k: (v, second[k]) for k, v in first.items()}

    def value(name: str, **labels) -> float:
        (found,) = [v for (n, *ls), v in second.items() if n == name and all(ls_ in ls for ls_ in labels.items())]
        return found

    assert value("graphserve_engine_busy_seconds_total", phase="decode") == 5.7
    assert value("graphserve_prefix_cache_queries_tokens_total") == 80
    assert value("graphserve_decode_steps_total", bucket_id="decode_bs_8") == 1
    assert value("graphserve_decode_steps_total", bucket_id="decode_bs_1") == 1
    assert value("graphserve_lora_adapter_loads_total", result="refused") == 1
    assert value("graphserve_lora_generated_tokens_total", adapter="sql") == 40
    assert value("graphserve_shadow_verifications_total", result="match") == 41
    assert value("graphserve_preemptions_total") == 3
    assert value("graphserve_prefill_tokens_total") == 30

    after.record_busy("decode", 0.5)
    third = counters(render({"r1": carried.apply(engine_status(after, [], preemptions=1))}))
    assert third[("graphserve_engine_busy_seconds_total", ("phase", "decode"), ("replica", "r1"))] == 6.2
    assert third[("graphserve_preemptions_total", ("replica", "r1"))] == 4


def test_status_counters_and_rollout_signals_never_go_down_across_an_engine_restart():
    """/admin/status and the rollout's stage signals read the same status: its step totals, finished
    requests, cohort rows and calls and shadow totals restarted from zero with the engine (a stage's
    signals went 273 -> 117 graph rows with no traffic, and a guard would see fewer mismatches than
    the stage began with). Carried, each keeps its total and grows from there."""
    before = EngineStats("rev1", "sdpa")
    before.record_step("graph", "decode_bs_8", "none", rows=6, padding=2)
    before.record_step("eager", "decode_bs_8", "rollout_holdback", rows=4, padding=0)
    before.record_decode(10)
    before.record_prefill(2, 30, "eager", "prefill_eager", "none", 0)
    before.record_finish("stop", 0.1, 0.01)
    before.record_cohort_call("graph", 8, 0.004)
    shadow = [{"bucket_id": "decode_bs_8", "result": "mismatch", "count": 2}]
    carried = CarriedCounters()
    first = carried.apply(engine_status(before, shadow, preemptions=0) | {"requests": {}})
    first["stats"]["shadow"].update(checks=2, mismatches=2)
    first = carried.apply(first)

    after = EngineStats("rev1", "sdpa")  # restarted: one graph-cohort step, no holdback yet
    after.record_step("graph", "decode_bs_1", "none", rows=1, padding=0)
    after.record_decode(1)
    after.record_cohort_call("graph", 8, 0.001)
    second = engine_status(after, [], preemptions=0) | {"requests": {}}
    second["stats"]["shadow"].update(checks=0, mismatches=0)
    second = carried.apply(second)

    stats = second["stats"]
    assert (stats["decode_steps"], stats["prefill_steps"], stats["generated_tokens"]) == (2, 1, 13)
    assert (stats["prompt_tokens"], stats["finished_requests"]) == (30, {"stop": 1})
    assert stats["decode_batch_sizes"] == {1: 1, 10: 1}
    assert stats["cohorts"]["graph"]["rows"] == 7 and stats["cohorts"]["holdback"]["rows"] == 4
    assert stats["cohorts"]["graph"]["calls"] == {8: [2, 0.005]}
    assert (stats["shadow"]["checks"], stats["shadow"]["mismatches"]) == (2, 2)
    assert sum(s["steps"] for s in stats["decode_step_parts"]) == 3  # model calls: a split step makes two

    was, now = signals_from_statuses({"r1": first}), signals_from_statuses({"r1": second})
    grew = now.minus(was)
    assert (grew.graph.rows, grew.holdback.rows, grew.shadow_mismatches) == (1, 0, 0)
    assert grew.graph.step_s == {8: (1, 0.001)}
