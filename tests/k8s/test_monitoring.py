"""The PodMonitors (k8s/components/monitoring: in the gpu overlay, optional for cpu-dev) scrape Ray's
metrics agent on every Ray Pod and graphserve's own /metrics exactly once per cluster. (No Prometheus
Operator CRD is available offline, so the PodMonitor fields are checked against the subset of its v1
schema these manifests use.)"""

from __future__ import annotations

import pytest

from . import manifests as m

SPEC_FIELDS = {"selector", "podMetricsEndpoints", "podTargetLabels", "namespaceSelector", "jobLabel"}
ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels", "relabelings"}


@pytest.fixture(params=m.MONITORED)
def docs(request, rendered) -> list[dict]:
    return rendered[request.param]


def test_monitoring_is_where_the_overlays_say(rendered):
    with_monitors = {t for t in [*m.TARGETS, m.CPU_DEV_MONITORED] if m.find(rendered[t], "PodMonitor")}
    assert with_monitors == set(m.MONITORED)


def test_podmonitor_fields(docs):
    for monitor in m.find(docs, "PodMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(monitor["spec"]) <= SPEC_FIELDS
        assert monitor["spec"]["selector"], "an empty selector would scrape every Pod in the namespace"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert set(endpoint) <= ENDPOINT_FIELDS and endpoint["path"] == "/metrics"


def test_ray_metrics_from_every_ray_pod(docs):
    """Serve's replica, proxy and ingress metrics live on the worker Pods' metrics agents."""
    monitor = m.one(docs, "PodMonitor", "graphserve-ray")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for node_type, group in m.groups(docs):
        assert m.selects(monitor["spec"]["selector"], m.pod_labels(node_type, group)), f"{node_type} Pods not scraped"
        assert m.named_port(m.ray_container(group), endpoint["port"]), f"{node_type}: no port {endpoint['port']}"


def test_app_metrics_once_per_cluster(docs):
    """graphserve's /metrics already aggregates every replica (a `replica` label per series): one
    target, the head, whose proxy answers even before any replica is ready."""
    monitor = m.one(docs, "PodMonitor", "graphserve-app")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    scraped = [t for t, g in m.groups(docs) if m.selects(monitor["spec"]["selector"], m.pod_labels(t, g))]
    assert scraped == ["head"]
    port = m.named_port(m.ray_container(m.head(docs)), endpoint["port"])
    assert port == m.serve_config(docs)["http_options"]["port"]
    assert m.serve_config(docs)["proxy_location"] in ("EveryNode", "HeadOnly"), "no Serve proxy on the head"


def test_podmonitors_do_not_overlap(docs):
    """No Pod port is scraped by two monitors (that would duplicate every series)."""
    seen = set()
    for monitor in m.find(docs, "PodMonitor"):
        for node_type, group in m.groups(docs):
            if m.selects(monitor["spec"]["selector"], m.pod_labels(node_type, group)):
                for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                    key = (node_type, group.get("groupName"), endpoint["port"], endpoint["path"])
                    assert key not in seen, f"{key} scraped twice"
                    seen.add(key)
