"""The controller's state file (tenant toggles, audit log) survives the detached controller actor
being restarted on another node: in both overlays it lies on the graphserve-state claim, which every
Ray container mounts read-write, so every node the actor may land on sees the same file."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from app.config import AppConfig

from . import manifests as m

CLAIM = "graphserve-state"
ACCESS = {"overlays/gpu": ["ReadWriteMany"], "overlays/cpu-dev": ["ReadWriteOnce"]}  # cpu-dev: single node
RAY_GROUP_ID = 100  # the `users` group of Ray's images, which their `ray` user belongs to


def state_path(docs: list[dict]) -> PurePosixPath:
    return PurePosixPath(AppConfig.from_args(m.app_args(docs)).for_app("graphserve").controller_state_path)


@pytest.mark.parametrize("target", m.TARGETS)
def test_no_target_keeps_state_in_tmp(target, rendered):
    """/tmp is the node's (or the container's): a restart elsewhere starts from nothing."""
    assert not state_path(rendered[target]).is_relative_to("/tmp")


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_state_file_is_on_the_shared_claim_in_every_ray_container(overlay, rendered):
    target = f"overlays/{overlay}"
    docs = rendered[target]
    path = state_path(docs)
    for node_type, group in m.groups(docs):
        spec = group["template"]["spec"]
        mounts = [v for v in m.ray_container(group)["volumeMounts"] if path.is_relative_to(v["mountPath"])]
        assert len(mounts) == 1, f"{node_type}: {path} is on no mounted volume (or on several)"
        assert not mounts[0].get("readOnly", False), f"{node_type}: the state volume is read-only"
        (volume,) = [v for v in spec["volumes"] if v["name"] == mounts[0]["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] == CLAIM, node_type
        assert spec["securityContext"]["fsGroup"] == RAY_GROUP_ID, f"{node_type}: the Ray user cannot write it"
    claim = m.one(docs, "PersistentVolumeClaim", CLAIM)
    assert claim["spec"]["accessModes"] == ACCESS[target]
    assert m.quantity(claim["spec"]["resources"]["requests"]["storage"]) <= 2**30  # one small JSON file
