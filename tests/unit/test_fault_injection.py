"""The deployed-server test's fault: armed only by its variable, which reaches the engine child (no
secret does), and it perturbs exactly the bucket the file names, switched on and off while running."""

from __future__ import annotations

import pytest
import torch

from workers.front.engine_process import child_environment
from workers.graphs import fault_injection


def replays() -> dict:
    return {b: (lambda b=b: torch.zeros(b, 16)) for b in (1, 4)}


def test_unarmed_nothing_is_wrapped(monkeypatch):
    monkeypatch.delenv(fault_injection.VARIABLE, raising=False)
    table = replays()
    original = dict(table)
    fault_injection.arm_from_environment(table)
    assert table == original


def test_the_named_bucket_drifts_while_the_file_names_it(monkeypatch, tmp_path):
    path = tmp_path / "fault"
    monkeypatch.setenv(fault_injection.VARIABLE, str(path))
    monkeypatch.setattr(fault_injection, "READ_EVERY_S", 0.0)
    table = replays()
    fault_injection.arm_from_environment(table)
    assert all(not table[b]().any() for b in (1, 4))  # no file: no fault
    path.write_text("4\n")
    assert not table[1]().any()
    out = table[4]()
    assert (out[:, :8] == 1e4).all() and not out[:, 8:].any()
    path.write_text("not a bucket")
    assert not table[4]().any()


@pytest.mark.parametrize("name", [fault_injection.VARIABLE, "GRAPHSERVE_CACHE"])
def test_the_variable_reaches_the_engine_child(name):
    env = child_environment({name: "/tmp/x", "GRAPHSERVE_ADMIN_TOKEN": "secret", "GRAPHSERVE_API_KEYS": "a:b"})
    assert env[name] == "/tmp/x" and "GRAPHSERVE_ADMIN_TOKEN" not in env and "GRAPHSERVE_API_KEYS" not in env
