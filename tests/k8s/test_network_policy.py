"""Who can reach the Ray Pods (k8s/base/network-policy.yaml, plus the metrics rule of the monitoring
component), evaluated with NetworkPolicy's own semantics: only the cluster's own Ray Pods reach the
Ray ports, anyone reaches the Serve port behind the API Service, the KubeRay operator reaches the
head's dashboard. And Ray's token authentication is on, so what can reach a Ray port still cannot
join the cluster without the token."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import pytest

from . import manifests as m

NAMESPACE = "graphserve"  # what docs/kubernetes.md applies the manifests to
# Ray's ports between its Pods: GCS, dashboard, client, dashboard agent, metrics, and ports Ray picks
# at random (raylet, object manager, runtime-env agent, one per worker process in 10002-19999).
RAY_PORTS = (6379, 8265, 10001, 52365, 8080, 43017, 10002, 19999)


@dataclass(frozen=True)
class Source:
    """Where a connection comes from: a Pod (its labels and its namespace's labels) or, with
    labels None, an address that is no Pod (a client outside the cluster, a load balancer)."""

    labels: dict | None
    namespace: str = NAMESPACE
    ip: str = "203.0.113.7"
    namespace_labels: dict = field(default_factory=dict)

    def ns_labels(self) -> dict:
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def peer_matches(peer: dict, source: Source) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        address = ipaddress.ip_address(source.ip)
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except", [])
        )
    if source.labels is None:  # pod and namespace selectors match Pods only
        return False
    if "namespaceSelector" in peer:
        in_namespace = m.selects(peer["namespaceSelector"], source.ns_labels())
    else:
        in_namespace = source.namespace == NAMESPACE  # a bare podSelector: the policy's own namespace
    return in_namespace and m.selects(peer.get("podSelector", {}), source.labels)


def port_matches(rule: dict, port: int) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    return any(
        p.get("protocol", "TCP") == "TCP" and (p["port"] == port or p["port"] <= port <= p.get("endPort", p["port"]))
        for p in ports
    )


def allowed(policies: list[dict], target: dict[str, str], source: Source, port: int) -> bool:
    """NetworkPolicy ingress semantics: a Pod no policy selects takes everything; a selected Pod
    takes what any rule of any selecting policy allows (an absent `from` or `ports` = all)."""
    selecting = [
        p
        for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and m.selects(p["spec"]["podSelector"], target)
    ]
    if not selecting:
        return True
    return any(
        port_matches(rule, port) and (not rule.get("from") or any(peer_matches(peer, source) for peer in rule["from"]))
        for p in selecting
        for rule in p["spec"].get("ingress", [])
    )


@pytest.fixture(params=[*m.TARGETS, m.CPU_DEV_MONITORED])
def target(request) -> str:
    return request.param


@pytest.fixture
def docs(target, rendered) -> list[dict]:
    return rendered[target]


def ray_pods(docs: list[dict]) -> list[tuple[str, dict]]:
    return [(node_type, m.pod_labels(node_type, group)) for node_type, group in m.groups(docs)]


def test_policies_use_numeric_tcp_ports(docs):
    """Named ports would resolve per Pod; numbers keep the rules (and the check above) exact."""
    for policy in m.find(docs, "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            for port in rule.get("ports", []):
                assert isinstance(port["port"], int) and port.get("protocol") == "TCP", policy["metadata"]["name"]


def test_ray_pods_reach_each_other_on_every_ray_port(docs):
    policies = m.find(docs, "NetworkPolicy")
    for _, source in ray_pods(docs):
        for _, pod in ray_pods(docs):
            for port in RAY_PORTS:
                assert allowed(policies, pod, Source(source), port), (source, pod, port)


@pytest.mark.parametrize(
    "source",
    [
        Source({"app": "debug-shell"}),
        Source({"app.kubernetes.io/part-of": "graphserve"}),  # an app label alone is no Ray Pod
        Source({"app.kubernetes.io/part-of": "graphserve", "ray.io/is-ray-node": "yes"}, namespace="other-team"),
        Source({"app.kubernetes.io/name": "kuberay-operator"}, namespace="kuberay-system"),
        Source(None),
    ],
    ids=["pod-in-namespace", "app-label-only", "ray-pod-of-another-namespace", "kuberay-operator", "outside"],
)
def test_nothing_else_reaches_the_ray_ports(docs, source):
    """Other Pods, Ray Pods of another namespace and clients outside the cluster reach no Ray port
    (the operator: only the head's dashboard, below); the Serve port they all reach."""
    policies = m.find(docs, "NetworkPolicy")
    for node_type, pod in ray_pods(docs):
        for port in (6379, 10001, 52365, 43017, 10002, 19999):
            assert not allowed(policies, pod, source, port), (node_type, port)
        operator = source.labels == {"app.kubernetes.io/name": "kuberay-operator"}
        assert allowed(policies, pod, source, 8265) is (operator and node_type == "head"), (node_type, 8265)
        assert allowed(policies, pod, source, 8000), (node_type, "the Serve port")


def test_the_open_port_is_the_api_services_port(docs):
    """The one port open to all is the one Serve listens on and the API Service forwards to."""
    serve_port = m.serve_config(docs)["http_options"]["port"]
    (service_port,) = m.rayservice(docs)["spec"]["serveService"]["spec"]["ports"]
    assert service_port["targetPort"] == serve_port
    for _, pod in ray_pods(docs):
        assert allowed(m.find(docs, "NetworkPolicy"), pod, Source(None), serve_port)


def test_prometheus_reaches_the_metrics_port_only_with_the_monitoring_component(target, docs):
    policies = m.find(docs, "NetworkPolicy")
    prometheus = Source({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    for node_type, group in m.groups(docs):
        port = int(group["rayStartParams"].get("metrics-export-port", 8080))
        pod = m.pod_labels(node_type, group)
        assert allowed(policies, pod, prometheus, port) is (target in m.MONITORED), node_type
        assert not allowed(policies, pod, Source(None), port), f"{node_type}: metrics open outside the cluster"


def test_the_evaluation_is_not_vacuous(docs):
    """Without the policies everything would be allowed, so the denials above come from them."""
    pod = ray_pods(docs)[0][1]
    assert allowed([], pod, Source(None), 6379)
    assert not allowed(m.find(docs, "NetworkPolicy"), pod, Source(None), 6379)


def test_ray_token_authentication_is_on(docs):
    """authOptions.mode token: KubeRay generates the cluster's token into a Secret and sets
    RAY_AUTH_MODE/RAY_AUTH_TOKEN on every Ray container itself, which it skips for a container that
    already sets them; so none may, and no token is ever written into a manifest."""
    assert m.cluster(docs)["authOptions"] == {"mode": "token"}
    for node_type, group in m.groups(docs):
        names = {e["name"] for e in m.ray_container(group).get("env", [])}
        assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}, node_type
