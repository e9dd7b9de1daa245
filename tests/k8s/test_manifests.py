"""Every manifest parses, every kustomize target renders with a real kustomize, every core object
(top-level or embedded in the RayService) validates against the Kubernetes schemas, and no secret
material is committed."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from . import manifests as m

KUSTOMIZATIONS = sorted(m.K8S.rglob("kustomization.yaml"))
EXPECTED = {
    ("RayService", "graphserve"),
    ("ConfigMap", "graphserve-graph-policy"),
    ("Ingress", "graphserve-api"),
    ("NetworkPolicy", "graphserve-ray"),
    ("NetworkPolicy", "graphserve-ray-head-operator"),
}
MONITORS = {
    ("PodMonitor", "graphserve-ray"),
    ("PodMonitor", "graphserve-app"),
    ("NetworkPolicy", "graphserve-ray-metrics"),
    ("ConfigMap", "graphserve-dashboard"),
}
STATE = {("PersistentVolumeClaim", "graphserve-state")}
EXTRA = {
    "overlays/gpu": {
        ("PersistentVolumeClaim", "graphserve-models"),
        ("PersistentVolumeClaim", "graphserve-compile-cache"),
    }
    | MONITORS
    | STATE,
    "overlays/cpu-dev": STATE,
    m.CPU_DEV_MONITORED: MONITORS | STATE,
}


def kubernetes_validate():
    try:
        import kubernetes_validate.utils as kv
    except ImportError:
        m.missing("kubernetes-validate", "pip install -e '.[test]'")
    return kv


def validate_core(kv, obj: dict, where: str) -> None:
    """Strict validation (unknown fields are errors) against the newest Kubernetes schema the package
    ships; it carries its schemas, so this runs offline."""
    version = kv.latest_version()
    try:
        kv.validate(obj, version, strict=True)
        return
    except kv.ValidationError as e:
        problem = f"{'.'.join(str(p) for p in e.path)}: {e.message}"
    pytest.fail(f"{where}: {obj['kind']} {obj['metadata']['name']} is invalid for Kubernetes {version}: {problem}")


@pytest.mark.parametrize("path", sorted(m.K8S.rglob("*.yaml")), ids=lambda p: p.relative_to(m.K8S).as_posix())
def test_every_manifest_parses(path):
    docs = m.load_docs(path)
    assert docs, f"{path} is empty"
    if path.name in ("kustomization.yaml", m.OVERRIDES):
        assert all(isinstance(d, dict) for d in docs)
        return
    for doc in docs:
        if isinstance(doc, list):  # a JSON patch (RFC 6902)
            assert all({"op", "path"} <= set(op) for op in doc), f"{path}: not a JSON patch"
            continue
        assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{path}: a document without apiVersion/kind/metadata"
        assert doc["metadata"].get("name"), f"{path}: a {doc['kind']} without a name"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: p.parent.relative_to(m.K8S).as_posix())
def test_kustomization_references_exist_and_patches_hit(kustomization, rendered):
    """Without kustomize one could still trust this: every referenced file exists and every patch
    names an object (same kind and name) of the resources it patches (for a component: of the
    kustomizations that include it)."""
    here = kustomization.parent
    spec = yaml.safe_load(kustomization.read_text())
    assert (spec["apiVersion"], spec["kind"]) in (
        ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
        ("kustomize.config.k8s.io/v1alpha1", "Component"),
    )
    for resource in spec.get("resources", []):
        target = here / resource
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{kustomization}: {resource} missing"
    for component in spec.get("components", []):
        component_spec = yaml.safe_load((here / component / "kustomization.yaml").read_text())
        assert component_spec["kind"] == "Component", f"{kustomization}: {component} is not a Component"
    parents = [here / r for r in spec.get("resources", []) if (here / r / "kustomization.yaml").is_file()]
    if spec["kind"] == "Component":
        parents = [k.parent for k in KUSTOMIZATIONS if here.resolve() in includes(k)]
        assert parents, f"{kustomization}: a component no kustomization includes"
    patchable = [
        (d["kind"], d["metadata"]["name"])
        for p in parents
        for d in rendered[p.resolve().relative_to(m.K8S.resolve()).as_posix()]
    ]
    for component in spec.get("components", []):  # what a component adds can be patched here too
        for resource in yaml.safe_load((here / component / "kustomization.yaml").read_text()).get("resources", []):
            patchable += [(d["kind"], d["metadata"]["name"]) for d in m.load_docs(here / component / resource)]
    for patch in spec.get("patches", []):
        path = here / patch["path"]
        assert path.is_file(), f"{kustomization}: patch {patch['path']} missing"
        if "target" in patch:
            assert (patch["target"]["kind"], patch["target"]["name"]) in patchable, f"{patch} targets nothing"
        else:
            for doc in m.load_docs(path):
                assert (doc["kind"], doc["metadata"]["name"]) in patchable, f"{path}: patches nothing"


def includes(kustomization) -> set:
    spec = yaml.safe_load(kustomization.read_text())
    return {(kustomization.parent / c).resolve() for c in spec.get("components", [])}


@pytest.mark.parametrize("target", [*m.TARGETS, m.CPU_DEV_MONITORED])
def test_target_renders_the_expected_objects(target, rendered):
    objects = {(d["kind"], d["metadata"]["name"]) for d in rendered[target]}
    assert objects == EXPECTED | EXTRA.get(target, set())


@pytest.mark.parametrize("target", m.TARGETS)
def test_core_objects_validate(target, rendered):
    kv = kubernetes_validate()
    for obj in rendered[target]:
        if (obj["apiVersion"], obj["kind"]) in m.CRD_KINDS:
            continue  # checked against their CRDs in test_rayservice.py / test_monitoring.py
        validate_core(kv, obj, target)


@pytest.mark.parametrize("target", m.TARGETS)
def test_objects_embedded_in_the_rayservice_validate(target, rendered):
    """KubeRay turns these into real Pods and a Service: validate them as core objects too (strict,
    so a misspelt probe or volume field fails here, not at Pod creation)."""
    kv = kubernetes_validate()
    docs = rendered[target]
    for node_type, group in m.groups(docs):
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": node_type},
            "template": group["template"],
        }
        validate_core(kv, template, f"{target} {node_type} group")
    serve_service = m.rayservice(docs)["spec"]["serveService"]
    validate_core(kv, {"apiVersion": "v1", "kind": "Service", **serve_service}, f"{target} serveService")


@pytest.mark.parametrize("target", m.TARGETS)
def test_secrets_come_from_a_secret_by_reference(target, rendered):
    docs = rendered[target]
    assert not m.find(docs, "Secret"), "a Secret with its data is rendered; create it with kubectl instead"
    env_names = {arg: m.app_args(docs)[arg] for arg in ("api_keys_env", "admin_token_env", "admin_tokens_env")}
    for node_type, group in m.groups(docs):
        env = {e["name"]: e for e in m.ray_container(group).get("env", [])}
        for arg, name in env_names.items():
            assert name in env, f"{node_type}: {name} ({arg}) is not set"
            assert "value" not in env[name], f"{node_type}: {name} has an inline value"
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == m.SECRET_NAME and ref["key"] == name
        # Without API keys the app serves everyone: that key is required, so a missing Secret stops the
        # Pod (CreateContainerConfigError) instead of opening the API.
        assert not env[env_names["api_keys_env"]]["valueFrom"]["secretKeyRef"].get("optional", False)


def test_no_secret_material_is_tracked():
    try:
        tracked = subprocess.run(["git", "ls-files", "k8s"], cwd=m.REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [f for f in tracked.stdout.split() if (m.REPO / f).is_file()]  # tracked, not deleted since
    assert not [f for f in files if f.endswith(".env")], "an env file (secret material) is committed"
    for path in (m.REPO / f for f in files if f.endswith(".yaml")):
        for doc in m.load_docs(path):
            assert not (isinstance(doc, dict) and doc.get("kind") == "Secret"), f"{path} commits a Secret"
    ignored = subprocess.run(["git", "check-ignore", "-q", "k8s/graphserve-secrets.env"], cwd=m.REPO)
    assert ignored.returncode == 0, "k8s/*.env (where docs/kubernetes.md puts the secret env file) is not git-ignored"


def test_gpu_workers_mount_the_compile_cache_where_the_config_points(rendered):
    """args.compile_cache_dir of the GPU overlay lies inside a read-write volume of every GPU worker,
    backed by the graphserve-compile-cache claim."""
    (service,) = [d for d in rendered["overlays/gpu"] if d["kind"] == "RayService"]
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    pod = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    (mount,) = [
        v for v in pod["containers"][0]["volumeMounts"] if args["compile_cache_dir"].startswith(v["mountPath"] + "/")
    ]
    assert not mount.get("readOnly")
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == "graphserve-compile-cache"
