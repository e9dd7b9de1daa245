"""serveConfigV2 is config/graphserve.yaml (plus each overlay's documented overrides), the app accepts
it, its import path resolves, and k8s/sync_serve_config.py keeps it so."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys

import pytest
import yaml

from . import manifests as m


@pytest.mark.parametrize("target", m.TARGETS)
def test_serve_config_is_the_config_file_plus_overrides(target, rendered, config):
    """One source: the embedded Serve config equals config/graphserve.yaml with this target's
    serve-overrides.yaml merged into applications[0].args, and nothing else differs."""
    embedded = m.serve_config(rendered[target])
    expected = yaml.safe_load(yaml.safe_dump(config))
    expected["applications"][0]["args"] = m.deep_merge(config["applications"][0]["args"], m.overrides_for(target))
    assert embedded == expected


def test_base_embeds_the_config_file_verbatim():
    rayservice = m.load_docs(m.K8S / "base" / "rayservice.yaml")[0]
    assert rayservice["spec"]["serveConfigV2"] == m.CONFIG.read_text().rstrip("\n") + "\n"


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_overrides_are_documented_app_args(overlay):
    from app.config import AppConfig

    data = yaml.safe_load((m.K8S / "overlays" / overlay / m.OVERRIDES).read_text())
    assert set(data) == {"args"}
    assert set(data["args"]) <= set(AppConfig.model_fields), "an override that is not an AppConfig field"


@pytest.mark.parametrize("target", m.TARGETS)
def test_app_accepts_the_embedded_args(target, rendered):
    from app.config import AppConfig

    args = m.app_args(rendered[target])
    parsed = AppConfig.from_args(args).model_dump(mode="json")
    assert as_written(args, parsed), "AppConfig changed a value the config sets"


def as_written(written, parsed) -> bool:
    """Every value the config writes comes out of AppConfig unchanged (fields it leaves out may take
    defaults)."""
    if isinstance(written, dict):
        return isinstance(parsed, dict) and all(k in parsed and as_written(v, parsed[k]) for k, v in written.items())
    return written == parsed


@pytest.mark.parametrize("target", m.TARGETS)
def test_import_path_resolves_and_builds(target, rendered):
    """What Serve does with import_path and args, short of starting Ray: import, look up, call."""
    from ray.serve import Application

    (app,) = m.serve_config(rendered[target])["applications"]
    module_name, _, attribute = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module_name), attribute)
    assert callable(builder)
    assert isinstance(builder(app["args"]), Application)


@pytest.mark.parametrize("target", m.TARGETS)
def test_graph_policy_configmap_is_the_policy_in_force(target, rendered, tmp_path):
    from policies.graph_policy import GraphPolicy, load_policy

    docs = rendered[target]
    configmap = m.one(docs, "ConfigMap", "graphserve-graph-policy")
    path = tmp_path / "graph-policy.yaml"
    path.write_text(configmap["data"]["graph-policy.yaml"])
    assert load_policy(path) == GraphPolicy.model_validate(m.app_args(docs)["cuda_graph_policy"])
    # and every Ray container mounts it
    for node_type, group in m.groups(docs):
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        mounts = [v for v in m.ray_container(group)["volumeMounts"] if v["mountPath"] == "/etc/graphserve"]
        assert mounts and volumes[mounts[0]["name"]]["configMap"]["name"] == "graphserve-graph-policy", node_type


def run_sync(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(m.SYNC_SCRIPT), *args], capture_output=True, text=True, timeout=60)


def copy_tree(tmp_path):
    """The parts of the repository the sync script reads and writes."""
    for part in ("config", "k8s"):
        shutil.copytree(m.REPO / part, tmp_path / part)
    return tmp_path


def snapshot(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_sync_script_changes_nothing_on_the_committed_tree(tmp_path):
    check = run_sync("--check")
    assert check.returncode == 0, check.stderr
    root = copy_tree(tmp_path)
    before = snapshot(root)
    result = run_sync("--root", str(root))
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
    assert snapshot(root) == before


def test_sync_script_catches_and_repairs_divergence(tmp_path):
    root = copy_tree(tmp_path)
    config_path = root / "config" / "graphserve.yaml"
    config_path.write_text(config_path.read_text().replace("max_waiting: 256", "max_waiting: 16"))
    rayservice_before = (root / "k8s" / "base" / "rayservice.yaml").read_text()

    check = run_sync("--check", "--root", str(root))
    assert check.returncode == 1
    for stale in ("k8s/base/rayservice.yaml", *(f"k8s/overlays/{o}/serve-config.patch.yaml" for o in m.OVERLAYS)):
        assert stale in check.stderr
    assert "graph-policy.yaml" not in check.stderr  # the policy did not change

    assert run_sync("--root", str(root)).returncode == 0
    assert run_sync("--check", "--root", str(root)).returncode == 0
    rayservice_after = (root / "k8s" / "base" / "rayservice.yaml").read_text()
    assert yaml.safe_load(rayservice_after)["spec"]["serveConfigV2"] == config_path.read_text()
    # only the serveConfigV2 block changed: the hand-written rest (comments included) is kept
    changed = [(a, b) for a, b in zip(rayservice_before.splitlines(), rayservice_after.splitlines()) if a != b]
    assert len(rayservice_before.splitlines()) == len(rayservice_after.splitlines())
    assert changed == [("          max_waiting: 256", "          max_waiting: 16")]
    for overlay in m.OVERLAYS:
        patch = m.load_docs(root / "k8s" / "overlays" / overlay / "serve-config.patch.yaml")[0]
        assert yaml.safe_load(patch["spec"]["serveConfigV2"])["applications"][0]["args"]["max_waiting"] == 16


def test_sync_script_refuses_malformed_overrides(tmp_path):
    root = copy_tree(tmp_path)
    (root / "k8s" / "overlays" / "gpu" / m.OVERRIDES).write_text("accelerator: gpu\n")
    result = run_sync("--check", "--root", str(root))
    assert result.returncode != 0 and "`args`" in result.stderr
