"""A replica runs its engine's step loop in a child process. Killed under load, the child is started
again in place: streams that had tokens end with an error event in OpenAI's shape and [DONE], a
non-streamed request that had begun gets a 503 with Retry-After, requests that had no token yet are
served by the new engine, and /v1 serves again within 15 s, all on the same replica. Past the
restart budget the replica fails its health check and Serve replaces it. Deleting the application
leaves no engine process behind to hold a device."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from ray import serve

from tests.integration.helpers import httpx, running_app, wait_for

pytestmark = pytest.mark.timeout(300)
APP = "child"
RUNNING = 4  # max_num_seqs: the requests decoding when the engine is killed; the rest wait in its queue
STREAMS = 5  # with the plain request: 4 decoding, 2 waiting (and a free slot for the recovery probe after)
MAX_TOKENS = 3000  # seconds of the tiny model's steps: still running when the kill comes
# The slot holders of the cancel test: ~10 s of steps (~9 ms a step of 4 rows on CPU), still decoding
# long after the waiting client gives up (1 s), and each must then run to the end.
BLOCKER_TOKENS = 1000
RECOVERY_TARGET_S = 15.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    wait_for(lambda: not engine_pids(), 30, what="engine processes of earlier tests to exit")
    args = {"max_num_seqs": RUNNING, "max_model_len": 4096, "engine_max_restarts": 1}
    with running_app(tmp_path_factory.mktemp(APP), name=APP, admin_token="admin-child", args=args) as s:
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
        if b"workers.front.engine_main" in argv:
            pids.add(int(proc.name))
    return pids


class Client(threading.Thread):
    """One request in a thread: a stream (its SSE payloads, and whether text had arrived) or a
    plain request (its status, headers and body)."""

    def __init__(self, server, stream: bool, max_tokens: int = MAX_TOKENS) -> None:
        super().__init__(daemon=True)
        self.server, self.stream, self.max_tokens = server, stream, max_tokens
        self.had_text = threading.Event()
        self.payloads: list[str] = []
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": self.server.model,
            "prompt": "Hello",
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": self.stream,
        }
        try:
            with httpx.Client(base_url=self.server.base_url, timeout=120) as http:
                if not self.stream:
                    self.response = http.post("/v1/completions", json=body, headers=self.server.key_headers())
                    return
                with http.stream("POST", "/v1/completions", json=body, headers=self.server.key_headers()) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        payload = line[len("data: ") :]
                        self.payloads.append(payload)
                        if payload != "[DONE]" and json.loads(payload).get("choices", [{}])[0].get("text"):
                            self.had_text.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def completed(client: Client) -> bool:
    events = [json.loads(p) for p in client.payloads[:-1]]
    return bool(events) and events[-1]["choices"][0]["finish_reason"] == "length"


def ended_with_error(client: Client) -> bool:
    events = [json.loads(p) for p in client.payloads[:-1]]
    return bool(events) and set(events[-1]) == {"error"} and events[-1]["error"]["message"]


def test_request_cancelled_before_its_first_token_is_counted(server):
    """A client that leaves while its request waits for a slot: the replica counts it as cancelled."""

    def cancelled() -> int:
        counts = server.replica_status()["requests"]["requests"]
        return sum(c["count"] for c in counts if c["outcome"] == "cancelled")

    before = cancelled()
    blockers = [Client(server, stream=True, max_tokens=BLOCKER_TOKENS) for _ in range(RUNNING)]
    for client in blockers:
        client.start()
    wait_for(lambda: all(c.had_text.is_set() for c in blockers), 30, what="every slot decoding")
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 8}
    with pytest.raises(httpx.ReadTimeout):  # still queued behind the blockers when the client gives up
        httpx.post(server.v1 + "/completions", json=body, headers=server.key_headers(), timeout=1.0)
    for client in blockers:
        client.join(120)
        assert completed(client), client.payloads[-2:]
    wait_for(lambda: cancelled() == before + 1, 30, what="the request that left to be counted as cancelled")


def test_killed_engine_restarts_in_place_and_loses_no_waiting_request(server):
    before = server.replica_status()
    (pid,) = engine_pids()
    plain = Client(server, stream=False)
    plain.start()  # first in line: it is decoding when the kill comes
    wait_for(
        lambda: server.replica_status()["stats"]["prefill_steps"] > before["stats"]["prefill_steps"],
        30,
        what="the plain request to start decoding",
    )
    streams = [Client(server, stream=True) for _ in range(STREAMS)]
    for client in streams:
        client.start()
    wait_for(lambda: sum(c.had_text.is_set() for c in streams) >= RUNNING - 1, 30, what="three streams decoding")
    decoding = [c for c in streams if c.had_text.is_set()]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(
        lambda: server.complete().status_code == 200,
        RECOVERY_TARGET_S,
        interval=0.2,
        what="/v1 serving again after the kill",
    )
    recovery_s = time.monotonic() - killed_at
    for client in [plain, *streams]:
        client.join(120)
        assert not client.is_alive() and client.error is None, client.error
    assert recovery_s < RECOVERY_TARGET_S

    # Every stream ended with [DONE]: those that had tokens with an error event, the others complete.
    assert all(c.payloads and c.payloads[-1] == "[DONE]" for c in streams), [c.payloads[-2:] for c in streams]
    assert all(ended_with_error(c) for c in decoding)
    waiting = [c for c in streams if c not in decoding]
    assert all(completed(c) or (ended_with_error(c) and c.had_text.is_set()) for c in waiting)
    assert sum(completed(c) for c in waiting) >= STREAMS - RUNNING  # requests without a token were served
    assert plain.response.status_code == 503 and plain.response.headers["retry-after"]
    assert set(plain.response.json()) == {"error"}

    # The same replica serves with a new engine process.
    after = server.replica_status()
    assert after["replica_id"] == before["replica_id"] and after["engine_restarts"] == 1
    assert after["state"] == "READY"
    assert engine_pids() and pid not in engine_pids()


def test_past_the_restart_budget_the_replica_is_replaced(server):
    before = server.replica_status()["replica_id"]
    (pid,) = engine_pids()
    os.kill(pid, signal.SIGKILL)  # the second death: engine_max_restarts=1 is spent

    def replaced() -> bool:
        replicas = server.admin_status()["replicas"]
        return before not in replicas and server.complete().status_code == 200

    wait_for(replaced, 150, interval=1.0, what="a new replica with a fresh engine serving")
    assert pid not in engine_pids()


def test_deleting_the_app_leaves_no_engine_process(server):
    assert engine_pids()
    serve.delete(f"graphserve-{APP}")
    wait_for(lambda: not engine_pids(), 60, what="every engine process to exit")
