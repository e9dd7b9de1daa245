"""The Grafana dashboard (k8s/components/monitoring/graphserve-dashboard.json): a valid dashboard
whose every query reads only metrics graphserve's /metrics exports, shipped as a ConfigMap that
Grafana's sidecar picks up wherever the monitoring component is included."""

from __future__ import annotations

import json
import re

from app.metrics import render

from . import manifests as m

DASHBOARD = m.K8S / "components" / "monitoring" / "graphserve-dashboard.json"
METRIC = re.compile(r"\bgraphserve_[a-z_]+")
# What the dashboard must show (issue 17): a metric each.
MUST_SHOW = [
    "graphserve_decode_rows_total",
    "graphserve_decode_steps_total",
    "graphserve_ttft_seconds_bucket",
    "graphserve_tpot_seconds_bucket",
    "graphserve_kv_pages_free",
    "graphserve_rollout_phase",
    "graphserve_rollout_percent",
    "graphserve_shadow_verifications_total",
    "graphserve_lora_adapters_loaded",
    "graphserve_lora_generated_tokens_total",
]


def exported() -> set[str]:
    """Every series name /metrics can carry (histograms with their _bucket, _sum and _count)."""
    names = set()
    for line in render({}, None).decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return names


def test_the_dashboard_is_valid_and_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    ids, queried = set(), set()
    for panel in dashboard["panels"]:
        assert panel["id"] not in ids and panel["title"] and panel["type"] in ("timeseries", "stat", "table")
        ids.add(panel["id"])
        assert panel["datasource"]["uid"] == "${datasource}" and set(panel["gridPos"]) == {"x", "y", "w", "h"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs)
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            queried |= set(METRIC.findall(target["expr"]))
    assert queried <= exported(), sorted(queried - exported())
    assert set(MUST_SHOW) <= queried


def test_the_dashboard_ships_as_a_configmap_for_grafanas_sidecar(rendered):
    for target in m.MONITORED:
        (config_map,) = [
            d for d in m.find(rendered[target], "ConfigMap") if d["metadata"]["name"] == "graphserve-dashboard"
        ]
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(config_map["data"]["graphserve-dashboard.json"]) == json.loads(DASHBOARD.read_text())
