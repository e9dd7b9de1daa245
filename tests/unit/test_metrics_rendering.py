"""/metrics for the rollout and shadow verification: the series docs/metrics.md names, from the payloads
replicas and the controller really produce."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from app.controller import GraphController
from app.metrics import render


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
    c.start_rollout({"steps": [{"percent": 5, "hold_s": 60}, {"percent": 100}], "guards": {"failure_limit": 1}}, "a")
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
