"""A replica runs its engine's step loop in a child process. Killing that process fails the
replica's health check and Serve replaces the replica, after which traffic is served by a fresh
engine; deleting the application leaves no engine process behind to hold a device."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from ray import serve

from tests.integration.helpers import assert_openai_error, running_app, wait_for

pytestmark = pytest.mark.timeout(180)
APP = "child"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    wait_for(lambda: not engine_pids(), 30, what="engine processes of earlier tests to exit")
    with running_app(tmp_path_factory.mktemp(APP), name=APP, admin_token="admin-child") as s:
        s.wait_ready()
        yield s


def engine_pids() -> set[int]:
    """Every live engine process on this machine (this module's app is the only one running)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")  # empty for a zombie
        except OSError:
            continue
        if b"workers.engine_process" in argv:
            pids.add(int(proc.name))
    return pids


def test_killed_engine_fails_health_and_replica_is_replaced(server):
    (pid,) = engine_pids()
    os.kill(pid, signal.SIGKILL)
    r = server.complete()
    if r.status_code != 200:  # before the health check notices, the old replica says why it cannot serve
        assert_openai_error(r, 503, "engine")

    def replaced() -> bool:
        return bool(engine_pids() - {pid}) and server.complete().status_code == 200

    wait_for(replaced, 120, interval=1.0, what="a new replica with a fresh engine serving")
    assert pid not in engine_pids()


def test_deleting_the_app_leaves_no_engine_process(server):
    assert engine_pids()
    serve.delete(f"graphserve-{APP}")
    wait_for(lambda: not engine_pids(), 60, what="every engine process to exit")
