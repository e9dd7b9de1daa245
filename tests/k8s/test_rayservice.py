"""The RayService of every kustomize target: valid for KubeRay v1.7.0's CRD (and its admission rules),
and wired so that traffic means "capture complete", the dashboard stays inside the cluster, the GPU
worker group holds what Serve's autoscaling asks for, and the image is named once."""

from __future__ import annotations

import re
import tomllib

import jsonschema
import pytest
import yaml

from app.config import AppConfig

from . import manifests as m

MAX_RAYSERVICE_NAME = 47  # KubeRay: MaxRayClusterNameLength (53) - 6
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
INIT_TIMEOUT = "ray.io/initializing-timeout"


def unknown_fields(obj, schema: dict, path: str = "") -> list[str]:
    """Fields the schema does not declare. The API server prunes these silently (a typo such as
    `enableInTreeAutoScaling` would just vanish), so they are errors here."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(obj, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        found = []
        for key, value in obj.items():
            if props is not None and key in props:
                found += unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, f"{path}.{key}")
            elif props is not None or extra is False:
                found.append(f"{path}.{key}")
        return found
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [u for i, item in enumerate(obj) for u in unknown_fields(item, schema["items"], f"{path}[{i}]")]
    return []


@pytest.fixture(params=m.TARGETS)
def docs(request, rendered) -> list[dict]:
    return rendered[request.param]


def test_validates_against_the_kuberay_crd(docs, rayservice_schema):
    rs = m.rayservice(docs)
    assert rs["apiVersion"] == "ray.io/v1"
    errors = sorted(jsonschema.Draft7Validator(rayservice_schema).iter_errors(rs), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)
    assert not unknown_fields(rs, rayservice_schema), "fields unknown to the CRD (pruned by the API server)"


def test_crd_check_catches_mistakes(docs, rayservice_schema):
    """The two checks above are not vacuous."""
    rs = yaml.safe_load(yaml.safe_dump(m.rayservice(docs)))
    rs["spec"]["rayClusterConfig"]["enableInTreeAutoScaling"] = True
    assert unknown_fields(rs, rayservice_schema) == [".spec.rayClusterConfig.enableInTreeAutoScaling"]
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "two"
    assert not jsonschema.Draft7Validator(rayservice_schema).is_valid(rs)


def test_kuberay_admission_rules(docs):
    """What KubeRay's own validation (ValidateRayServiceMetadata/Spec) would refuse."""
    rs = m.rayservice(docs)
    name = rs["metadata"]["name"]
    assert len(name) <= MAX_RAYSERVICE_NAME and DNS1035.fullmatch(name)
    assert m.go_duration_s(rs["metadata"]["annotations"][INIT_TIMEOUT]) > 0
    assert rs["spec"]["upgradeStrategy"]["type"] in ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")
    assert not m.head(docs).get("headService", {}).get("metadata", {}).get("name")
    for node_type, group in m.groups(docs):
        assert group["template"]["spec"]["containers"], f"{node_type} group without containers"
        assert "labels" not in group.get("rayStartParams", {})
        assert not (group.get("resources") and set(group["rayStartParams"]) & {"num-cpus", "num-gpus", "memory"})
    for group in m.workers(docs):
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]


def test_head_is_control_plane_only(docs):
    """No GPUs on the head, no Serve work on it, and no probe that needs the app: KubeRay deploys the
    app only after the head Pod is Ready."""
    group = m.head(docs)
    container = m.ray_container(group)
    for section in ("requests", "limits"):
        assert not any("gpu" in r for r in container["resources"].get(section, {})), "GPU on the head"
    assert group["rayStartParams"]["num-gpus"] == "0" and group["rayStartParams"]["num-cpus"] == "0"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert probe not in container, f"head {probe}: KubeRay's own probes must stay (see rayservice.yaml)"


def test_worker_readiness_means_capture_complete(docs):
    port = m.serve_config(docs)["http_options"]["port"]
    for group in m.workers(docs):
        container = m.ray_container(group)
        assert m.named_port(container, "serve") == port
        command = " ".join(container["readinessProbe"]["exec"]["command"])
        # the app's /readyz: 200 only once a replica is READY, i.e. its graphs are captured
        assert f"http://localhost:{port}/readyz" in command
        # the proxy's own health (what KubeRay's default worker probe checks): draining proxies leave
        assert f"http://localhost:{port}/-/healthz" in command
        assert "&&" in command and "||" not in command
        for probe in ("livenessProbe", "startupProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthz", "port": "serve"}, probe


def test_every_ray_container_runs_serve_behind_haproxy(docs):
    """HAProxy on port 8000 and the replicas' own HTTP servers are environment that every Ray
    process reads when it starts: a container without it would run the Python proxy beside
    HAProxy's nodes, or replicas that serve no HTTP for HAProxy to reach."""
    for node_type, group in m.groups(docs):
        env = {e["name"]: e.get("value") for e in m.ray_container(group).get("env", [])}
        assert env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1", node_type
        assert env.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1", node_type


def test_workers_outlive_the_initializing_timeout(docs):
    """Workers are not restarted for a slow start before KubeRay declares the RayService failed."""
    timeout = m.go_duration_s(m.rayservice(docs)["metadata"]["annotations"][INIT_TIMEOUT])
    for group in m.workers(docs):
        startup = m.ray_container(group)["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= timeout


def test_api_service_carries_only_ready_workers(docs):
    spec = m.rayservice(docs)["spec"]
    assert spec["excludeHeadPodFromServeSvc"] is True
    service = spec["serveService"]
    assert service["metadata"]["name"] == "graphserve-api"
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert "selector" not in service["spec"], "KubeRay owns the selector"
    (port,) = service["spec"]["ports"]
    assert port["name"] == "serve" and port["port"] == m.serve_config(docs)["http_options"]["port"]


def test_dashboard_and_admin_stay_inside_the_cluster(docs):
    group = m.head(docs)
    assert group.get("serviceType", "ClusterIP") == "ClusterIP"
    assert group.get("enableIngress", False) is False
    for service in m.find(docs, "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", f"{service['metadata']['name']} is exposed"
    for ingress in m.find(docs, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["path"] == "/v1" and path["pathType"] == "Prefix", "only /v1 may be routed"
                backend = path["backend"]["service"]
                assert backend["name"] == m.rayservice(docs)["spec"]["serveService"]["metadata"]["name"]
                assert backend["port"]["number"] == m.serve_config(docs)["http_options"]["port"]
        assert "defaultBackend" not in ingress["spec"]


def replica_shape(args: dict) -> tuple[float, int]:
    """(CPUs, GPUs) one LLM replica takes, all on one node, as app/builder.py asks Ray for them: the
    replica's CPUs, plus with tensor parallelism one STRICT_PACK bundle per shard (CPUs and a GPU)."""
    tp = args.get("tensor_parallel_size", 1)
    cpus = args.get("replica_num_cpus", 1.0) + (tp * args.get("shard_num_cpus", 1.0) if tp > 1 else 0)
    return cpus, (tp if args["accelerator"] == "gpu" else 0)


def placed(
    pods: int, pod_cpus: float, pod_gpus: int, replicas: int, replica: tuple[float, int], ingress: float, ingresses: int
):
    """First-fit: do `replicas` replicas and `ingresses` ingress replicas fit on `pods` worker Pods?"""
    free = [[pod_cpus, pod_gpus] for _ in range(pods)]
    for cpus, gpus in [replica] * replicas + [(ingress, 0)] * ingresses:
        pod = next((f for f in free if f[0] >= cpus and f[1] >= gpus), None)
        if pod is None:
            return False
        pod[0] -= cpus
        pod[1] -= gpus
    return True


def test_autoscaling_and_capacity(docs):
    """The worker group at maxReplicas Pods holds Serve's autoscaling.max_replicas LLM replicas (each
    with its tensor_parallel_size GPUs on one Pod) plus ingress_autoscaling.max_replicas ingress
    replicas; at minReplicas, the minimum of each."""
    cluster, args = m.cluster(docs), m.app_args(docs)
    assert cluster["enableInTreeAutoscaling"] is True
    (group,) = m.workers(docs)
    limits = m.ray_container(group)["resources"]["limits"]
    pod_cpus, pod_gpus = m.quantity(limits["cpu"]), int(m.quantity(limits.get("nvidia.com/gpu", 0)))
    replica, ingress = replica_shape(args), args.get("ingress_num_cpus", 0.5)
    auto, ingress_auto = args["autoscaling"], AppConfig.from_args(args).ingress_autoscaling
    levels = [
        (group["maxReplicas"], auto["max_replicas"], ingress_auto.max_replicas),
        (group["minReplicas"], auto["min_replicas"], ingress_auto.min_replicas),
    ]
    for pods, replicas, ingresses in levels:
        assert placed(pods, pod_cpus, pod_gpus, replicas, replica, ingress, ingresses), (
            f"{pods} worker Pods of {pod_cpus} CPUs / {pod_gpus} GPUs cannot hold {replicas} replicas of "
            f"{replica[0]} CPUs / {replica[1]} GPUs (tensor_parallel_size {args.get('tensor_parallel_size', 1)}) "
            f"plus {ingresses} ingress replicas"
        )


def test_metrics_ports_match_ray_start(docs):
    for node_type, group in m.groups(docs):
        port = int(group["rayStartParams"].get("metrics-export-port", 8080))
        assert m.named_port(m.ray_container(group), "metrics") == port, node_type


def test_one_image_named_once(docs):
    """The image (and so the Ray and Python versions) is named in k8s/base/kustomization.yaml; the
    RayService's rayVersion, k8s/Dockerfile's defaults and pyproject.toml agree with it."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    (image,) = yaml.safe_load((m.K8S / "base" / "kustomization.yaml").read_text())["images"]
    reference = f"{image['newName']}:{image['newTag']}"
    for node_type, group in m.groups(docs):
        assert m.ray_container(group)["image"] == reference, node_type
    tag = re.fullmatch(r"(?P<app>[\w.]+)-ray(?P<ray>\d+\.\d+\.\d+)-py(?P<py>3\d+)", image["newTag"])
    assert tag, f"tag {image['newTag']!r} should read <version>-ray<X.Y.Z>-py<3XY>"
    assert m.cluster(docs)["rayVersion"] == tag["ray"]
    dockerfile = (m.K8S / "Dockerfile").read_text()
    assert re.search(rf"^ARG RAY_VERSION={re.escape(tag['ray'])}$", dockerfile, re.M)
    assert re.search(rf"^ARG PYTHON_VERSION={tag['py']}$", dockerfile, re.M)
    project = tomllib.loads((m.REPO / "pyproject.toml").read_text())["project"]
    assert tag["app"] == project["version"]
    (ray_req,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "ray"]
    assert tag["ray"] in ray_req.specifier, f"the image's Ray {tag['ray']} vs pyproject's {ray_req}"
    python = f"{tag['py'][0]}.{tag['py'][1:]}"
    assert f"{python}.0" in SpecifierSet(project["requires-python"])


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_overlay_hardware(overlay, rendered):
    docs = rendered[f"overlays/{overlay}"]
    args = m.app_args(docs)
    (group,) = m.workers(docs)
    container = m.ray_container(group)
    resources = container["resources"]
    if overlay == "cpu-dev":
        assert args["accelerator"] == "cpu" and args["model"] is None
        assert "gpu" not in yaml.safe_dump(resources)
        return
    assert args["accelerator"] == "gpu"
    gpus = resources["limits"]["nvidia.com/gpu"]
    assert int(gpus) >= 1 and resources["requests"]["nvidia.com/gpu"] == gpus
    # the model directory lies on a read-only volume backed by the PVC this overlay renders
    mount = next(v for v in container["volumeMounts"] if args["model"].startswith(v["mountPath"].rstrip("/") + "/"))
    assert mount.get("readOnly") is True
    volume = next(v for v in group["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    m.one(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
