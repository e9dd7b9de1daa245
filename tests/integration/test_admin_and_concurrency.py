"""The admin API (tenant CUDA-graph toggles, audit, status, the controller's crash recovery) and the
serving path under concurrency (a burst of streams, a client that disconnects mid-stream).

One Ray instance for the module. It serves a slower random checkpoint than the embedded tiny model
(`write_slow_checkpoint`: ~10 ms per decode step on CPU, EOS never sampled greedily) so a stream of a
couple of hundred tokens lasts long enough to disconnect from, or to toggle its tenant, mid-flight.
On CPU no step can replay a CUDA graph: steps of permitted requests are recorded with
fallback_reason 'unavailable', those of a disabled tenant with 'tenant_disabled'. Operators are
`admin` (GRAPHSERVE_ADMIN_TOKEN) and `alice` and `bob` (GRAPHSERVE_ADMIN_TOKENS). Nothing here waits a
fixed time: every wait is for a condition, with a deadline.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import ray

from tests.integration.helpers import (
    ADMIN_CALL_IDS,
    ADMIN_CALLS,
    API_KEYS,
    httpx,
    json_events,
    running_app,
    settled,
    wait_for,
    write_slow_checkpoint,
)

pytestmark = pytest.mark.timeout(120)

ADMIN_TOKEN = "admin-" + uuid.uuid4().hex
OPERATOR_TOKENS = {"alice": "alice-" + uuid.uuid4().hex, "bob": "bob-" + uuid.uuid4().hex}
MODEL = "slow-llama"
LONG = 240  # tokens: ~3 s on the slow checkpoint; prompt + LONG stays within max_model_len 256
SHORT = 8  # tokens of a probe request: one from the prefill, SHORT - 1 from decode steps


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin")
    checkpoint = write_slow_checkpoint(tmp / MODEL)
    args = {"model": str(checkpoint), "served_model_name": MODEL}
    named = ",".join(f"{name}:{token}" for name, token in OPERATOR_TOKENS.items())
    with running_app(
        tmp, name="admin", args=args, admin_token=ADMIN_TOKEN, extra_env={"GRAPHSERVE_ADMIN_TOKENS": named}
    ) as s:
        s.wait_ready()
        yield s


def toggle_url(tenant: str) -> str:
    return f"/admin/tenants/{tenant}/cuda-graph"


def put_toggle(server, tenant: str, on: bool, operator: str | None = None, headers: dict | None = None):
    """PUT a toggle with `operator`'s token (None: the single GRAPHSERVE_ADMIN_TOKEN, operator admin)."""
    token = OPERATOR_TOKENS[operator] if operator else None
    return server.http.put(
        toggle_url(tenant), json={"cuda_graph": on}, headers={**server.admin_headers(token), **(headers or {})}
    )


def get_toggle(server, tenant: str) -> bool:
    r = server.http.get(toggle_url(tenant), headers=server.admin_headers())
    assert r.status_code == 200, r.text
    return r.json()["cuda_graph"]


def rows(status: dict, reason: str) -> int:
    """Decoded rows recorded under a fallback reason in a replica status."""
    return sum(p["rows"] for p in status["stats"]["decode_step_parts"] if p["fallback_reason"] == reason)


def controller(server):
    return ray.get_actor(server.controller_name, namespace=server.controller_namespace)


def audit(server) -> list[dict]:
    r = server.http.get("/admin/audit", headers=server.admin_headers())
    assert r.status_code == 200, r.text
    return r.json()["audit"]


def requests_counted(status: dict, tenant: str, outcome: str) -> int:
    return sum(r["count"] for r in status["requests"]["requests"] if r["tenant"] == tenant and r["outcome"] == outcome)


def decodes_as(server, tenant: str, reason: str) -> bool:
    """Whether a short request of `tenant` has all its decode rows recorded under `reason` (the
    replica's counters read before and after, each once it has stopped changing)."""
    before = settled(lambda: rows(server.replica_status(), reason))
    r = server.complete(tenant, max_tokens=SHORT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == SHORT, r.text
    return settled(lambda: rows(server.replica_status(), reason)) - before >= SHORT - 1


def wait_until_replica_applies(server, tenant: str, on: bool) -> None:
    """Replicas poll toggles every toggle_poll_s: wait (with a deadline) until a request of `tenant`
    decodes the way the toggle says."""
    reason = "unavailable" if on else "tenant_disabled"
    wait_for(lambda: decodes_as(server, tenant, reason), 60, interval=0, what=f"{tenant}'s requests to decode {reason}")


# -- the admin API -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS, ids=ADMIN_CALL_IDS)
def test_admin_requires_the_token(server, method, path, body):
    """No bearer token -> 401; a wrong one (or a tenant API key) -> 403; nothing changes."""
    calls = [
        ({}, 401),
        ({"Authorization": "Bearer wrong-token"}, 403),
        (server.key_headers("tenant-a"), 403),
        ({"Authorization": f"Basic {ADMIN_TOKEN}"}, 401),
    ]
    for headers, status in calls:
        r = server.http.request(method, path, json=body, headers=headers)
        assert r.status_code == status, (headers, r.status_code, r.text)
        assert r.json()["detail"]
    assert get_toggle(server, "tenant-a") is True


def test_status_reports_each_replicas_startup_phases(server):
    """/admin/status says per replica where its start went: each phase non-negative, all of them
    within the engine's start, which is within the replica's own (the engine process's start too)."""
    startup = server.replica_status()["startup"]
    phases = startup["phases"]
    assert set(phases) == {"load", "allocate", "compile", "capture", "verify", "warmup"}
    assert all(s >= 0 for s in phases.values()) and phases["load"] > 0, phases
    assert sum(phases.values()) <= startup["total_s"] <= startup["replica_s"], startup


def test_unknown_tenant_is_404(server):
    """Toggles exist only for configured tenants or tenants with API keys."""
    for method, body in (("GET", None), ("PUT", {"cuda_graph": False})):
        r = server.http.request(method, toggle_url("tenant-zzz"), json=body, headers=server.admin_headers())
        assert r.status_code == 404, r.text
        assert "tenant-zzz" in r.json()["detail"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"cuda_graph": "yes"}', "cuda_graph"),
        (b'{"cuda_graph": 0}', "cuda_graph"),
        (b'{"cuda_graph": null}', "cuda_graph"),
        (b"{}", "cuda_graph"),
        (b'{"cuda_graph": false, "extra": 1}', "extra"),
        (b'{"cuda_graph": fal', "json"),
        (b"[false]", "json"),
        (b"", "json"),
    ],
    ids=["string", "int", "null", "missing", "extra-field", "malformed", "array", "empty"],
)
def test_bad_toggle_body_is_400(server, content, needle):
    """A toggle body that is not exactly {"cuda_graph": <bool>} is a 400 with a reason; no change."""
    headers = {**server.admin_headers(), "Content-Type": "application/json"}
    r = server.http.put(toggle_url("tenant-a"), content=content, headers=headers)
    assert r.status_code == 400, r.text
    assert needle in r.json()["detail"].lower()
    assert get_toggle(server, "tenant-a") is True


def test_toggle_round_trip_reaches_replica(server):
    """PUT cuda_graph=false -> 200 and GET shows false; tenant-a's decode rows then run eager as
    'tenant_disabled' while tenant-b's requests add no such rows; PUT true restores it."""
    r = put_toggle(server, "tenant-a", False, operator="alice")
    assert r.status_code == 200, r.text
    assert r.json()["cuda_graph"] is False and r.json()["tenant"] == "tenant-a"
    assert r.json()["updated_by"] == "alice"
    assert get_toggle(server, "tenant-a") is False
    assert get_toggle(server, "tenant-b") is True
    assert server.admin_status()["tenants"]["tenant-a"] is False
    wait_until_replica_applies(server, "tenant-a", on=False)
    parts = [
        p for p in server.replica_status()["stats"]["decode_step_parts"] if p["fallback_reason"] == "tenant_disabled"
    ]
    assert all(p["execution_mode"] == "eager" for p in parts)

    status = settled(server.replica_status, timeout=15)
    disabled, unavailable = rows(status, "tenant_disabled"), rows(status, "unavailable")
    r = server.complete("tenant-b", max_tokens=SHORT)
    assert r.status_code == 200
    wait_for(
        lambda: rows(server.replica_status(), "unavailable") >= unavailable + SHORT - 1,
        10,
        what="tenant-b's decode rows ('unavailable' on CPU)",
    )
    assert rows(server.replica_status(), "tenant_disabled") == disabled

    assert put_toggle(server, "tenant-a", True, operator="bob").json()["updated_by"] == "bob"
    assert get_toggle(server, "tenant-a") is True
    wait_until_replica_applies(server, "tenant-a", on=True)


def test_toggle_applies_to_a_running_request(server):
    """Disabling a tenant mid-stream moves its running request to eager from the next steps on,
    without interrupting it."""
    assert get_toggle(server, "tenant-a") is True
    wait_until_replica_applies(server, "tenant-a", on=True)  # whatever ran before, the replica has it on
    before = settled(lambda: rows(server.replica_status(), "tenant_disabled"))
    body = {
        "model": MODEL,
        "prompt": "toggle me",
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with server.http.stream("POST", "/v1/completions", json=body, headers=server.key_headers("tenant-a")) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"finish_reason": null' in first
        assert put_toggle(server, "tenant-a", False).status_code == 200
        rest = [line for line in lines if line.strip()]
    try:
        events = json_events([first, *rest])
        assert events[-1]["usage"]["completion_tokens"] == LONG  # it ran to the end
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        # the stream has ended: once the replica's reports stop changing they hold all its steps
        disabled = settled(lambda: rows(server.replica_status(), "tenant_disabled")) - before
        assert 0 < disabled < LONG - 1  # part of its decode steps ran before the toggle, part after
    finally:
        put_toggle(server, "tenant-a", True)


def test_audit_log(server):
    """Every toggle change is audited with the operator whose token made it (never a name the
    caller picks: X-Graphserve-Operator is ignored), the client's address, tenant, before and
    after; a PUT that changes nothing adds no entry."""
    assert get_toggle(server, "tenant-b") is True
    before = audit(server)
    spoof = {"X-Graphserve-Operator": "mallory"}
    assert put_toggle(server, "tenant-b", False, operator="bob", headers=spoof).status_code == 200
    assert put_toggle(server, "tenant-b", False, operator="alice").json()["updated_by"] == "bob"  # no change
    assert put_toggle(server, "tenant-b", True, headers=spoof).json()["updated_by"] == "admin"
    new = [e for e in audit(server) if e not in before]
    assert [(e["actor"], e["tenant"], e["before"], e["after"]) for e in new] == [
        ("bob", "tenant-b", True, False),
        ("admin", "tenant-b", False, True),
    ]
    assert all(e["action"] == "set_cuda_graph" and e["time"] > 0 and e["client"] == "127.0.0.1" for e in new)
    assert new[0]["time"] <= new[1]["time"]


NOT_YET = {"/admin/rollouts/current": (404,), "/admin/buckets/recommendation": (200, 409)}


def test_every_operator_token_works_and_nothing_else(server):
    """Each named token and the single token open every admin route (past authorization: the
    current rollout is a 404 while none has run, the bucket recommendation a 409 before any decode
    step); a token that is one character off does not."""
    for token in (ADMIN_TOKEN, *OPERATOR_TOKENS.values()):
        for method, path, _ in ADMIN_CALLS:
            if method == "GET":
                r = server.http.get(path, headers=server.admin_headers(token))
                assert r.status_code in NOT_YET.get(path.partition("?")[0], (200,)), (path, r.text)
        assert server.http.get("/admin/status", headers=server.admin_headers(token[:-1])).status_code == 403
        assert server.http.get("/admin/status", headers=server.admin_headers(token + "0")).status_code == 403


def test_a_toggle_that_cannot_be_persisted_changes_nothing(server):
    """When the controller cannot write its state file the PUT is refused with a 4xx JSON reason,
    and the tenant's toggle, the version replicas poll and the audit log are all unchanged."""
    actor = controller(server)
    path = ray.get(actor.__ray_call__.remote(lambda self: self.path), timeout=30)
    version, _ = ray.get(actor.get_toggles.remote(), timeout=30)
    before = audit(server)
    unwritable = Path(os.devnull) / "graphserve" / "controller-state.json"  # under a device file: even root fails
    ray.get(actor.__ray_call__.remote(lambda self: setattr(self, "path", unwritable)), timeout=30)
    try:
        r = put_toggle(server, "tenant-a", False, operator="alice")
        assert r.status_code == 409, r.text
        assert "not changed" in r.json()["detail"] and "state file" in r.json()["detail"]
        assert get_toggle(server, "tenant-a") is True
        assert ray.get(actor.get_toggles.remote(), timeout=30)[0] == version
        assert audit(server) == before
    finally:
        ray.get(actor.__ray_call__.remote(lambda self: setattr(self, "path", path)), timeout=30)
    assert put_toggle(server, "tenant-a", False, operator="alice").json()["cuda_graph"] is False
    assert put_toggle(server, "tenant-a", True, operator="alice").json()["cuda_graph"] is True


def test_admin_token_never_returned(server):
    """The admin token (and the API keys) appear in no response body or header, errors included."""
    responses = [
        server.http.get("/admin/status", headers=server.admin_headers()),
        server.http.get("/admin/audit", headers=server.admin_headers()),
        server.http.get(toggle_url("tenant-a"), headers=server.admin_headers()),
        put_toggle(server, "tenant-a", True),
        server.http.get(toggle_url("tenant-zzz"), headers=server.admin_headers()),
        server.http.put(toggle_url("tenant-a"), content=b"{", headers=server.admin_headers()),
        server.http.put(toggle_url("tenant-a"), json={"cuda_graph": "x"}, headers=server.admin_headers()),
        server.http.get("/admin/status", headers=server.admin_headers(ADMIN_TOKEN + "x")),
        server.http.get("/admin/status", headers=server.admin_headers(ADMIN_TOKEN[:-1])),
        server.http.get("/admin/status"),
        server.http.get("/metrics"),
        server.http.get("/readyz"),
        server.http.get("/v1/models", headers=server.key_headers()),
        server.http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ),
        server.complete("tenant-a", max_tokens=2),
    ]
    responses += [
        server.http.get("/admin/audit", headers=server.admin_headers(OPERATOR_TOKENS["alice"])),
        server.http.get("/admin/status", headers=server.admin_headers(OPERATOR_TOKENS["bob"][:-1])),
    ]
    for r in responses:
        for secret in (ADMIN_TOKEN, *OPERATOR_TOKENS.values(), *API_KEYS.values()):
            assert secret not in r.text, (r.request.url, r.text[:300])
            assert not any(secret in v for v in r.headers.values()), r.headers


def test_a_refused_admin_call_is_logged_to_a_file_without_the_token(server):
    """Under Serve's throughput-optimized mode a replica's stderr goes into Serve's buffered logger,
    and the app's warnings, which reached stderr through logging's last-resort handler, reached no
    file. The app's loggers now have a handler of their own on the worker's real stderr, untouched
    by that mode: its lines (with level and logger, which the last-resort handler does not write)
    are in the ingress worker's .err file, with the path and the reason, never the token tried.
    This suite runs without that mode; the handler's own format is what tells the two apart."""
    tried = f"{ADMIN_TOKEN}-not-it"
    assert server.http.get("/admin/status", headers=server.admin_headers(tried)).status_code == 403
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"

    def refusal_lines() -> list[str]:
        lines = []
        for path in logs.rglob("*"):
            if path.is_file() and path.suffix in (".err", ".out", ".log"):
                text = path.read_text(errors="replace")
                lines += [
                    line for line in text.splitlines() if "WARNING app.auth: admin call refused: reason=wrong" in line
                ]
        return lines

    lines = wait_for(refusal_lines, 30, what="the refused admin call in a log file")
    assert any("path='/admin/status'" in line for line in lines), lines
    assert all(ADMIN_TOKEN not in line for line in lines)


def _pid(actor, timeout: float = 30) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=timeout)


def _dead(actor) -> bool:
    try:
        ray.get(actor.__ray_call__.remote(lambda self: None), timeout=5)
    except ray.exceptions.RayActorError:
        return True
    return False


def _holds(condition: Callable[[], object]) -> bool:
    try:
        return bool(condition())
    except Exception:  # noqa: BLE001 - e.g. the controller restarting: not yet
        return False


def _traffic_until(server, condition: Callable[[], object], timeout: float, what: str) -> list[tuple[int, str]]:
    """Send small requests back to back until `condition()` holds (at least one request; fail the
    test after `timeout`); the (status, body) of those that failed."""
    failures, deadline = [], time.monotonic() + timeout
    while True:
        r = server.complete("tenant-a", max_tokens=2)
        if r.status_code != 200:
            failures.append((r.status_code, r.text[:200]))
        if _holds(condition):
            return failures
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def _lists_a_replica(actor) -> bool:
    return bool(ray.get(actor.replica_statuses.remote(), timeout=2))


def test_controller_restart_reloads_state(server):
    """The controller is killed and restarted by Ray: traffic keeps flowing meanwhile (until the
    restarted controller knows the replica again), the toggle set before survives (reloaded from
    the state file), and so does its audit entry; the admin API keeps answering."""
    r = put_toggle(server, "tenant-b", False, operator="bob")
    assert r.status_code == 200, r.text
    entries = audit(server)
    assert entries[-1]["actor"] == "bob" and entries[-1]["after"] is False
    actor = controller(server)
    pid = _pid(actor)
    ray.kill(actor, no_restart=False)
    failures = _traffic_until(
        server,
        lambda: _pid(actor, timeout=2) != pid and _lists_a_replica(actor),
        60,
        "the controller to come back and hear from the replica",
    )
    assert failures == []  # replicas stay READY for the ingress across the restart
    assert ray.get(actor.tenant.remote("tenant-b"), timeout=30)["cuda_graph"] is False
    assert get_toggle(server, "tenant-b") is False
    assert audit(server) == entries
    # The ingress's view may hold the restarted controller's empty list for up to its max age (1 s).
    wait_for(server.is_ready, 5, what="/readyz 200 again")
    assert put_toggle(server, "tenant-b", True).status_code == 200


def test_controller_killed_for_good_is_recreated(server):
    """Killed without restart, the controller is created again by its next caller and reloads the
    state file: admin GETs work again (answering 503 "retry" only while the new actor starts),
    traffic keeps flowing, replicas report again."""
    put = put_toggle(server, "tenant-b", False, operator="alice")
    assert put.status_code == 200, put.text
    actor = controller(server)
    pid = _pid(actor)
    ray.kill(actor, no_restart=True)
    wait_for(lambda: _dead(actor), 30, what="the controller to be dead")

    def answered():
        r = server.http.get(toggle_url("tenant-b"), headers=server.admin_headers())
        assert r.status_code in (200, 503), r.text
        return r if r.status_code == 200 else None

    r = wait_for(answered, 60, interval=0.5, what="the admin API to answer from a new controller")
    assert r.json() == put.json()  # the same toggle, time and operator, read back from the state file
    assert _pid(controller(server)) != pid
    failures = _traffic_until(
        server, lambda: _lists_a_replica(controller(server)), 30, "the replica to report to the new controller"
    )
    assert failures == []
    wait_for(server.is_ready, 5, what="/readyz 200 again")
    assert put_toggle(server, "tenant-b", True).json()["cuda_graph"] is True


# -- concurrency ---------------------------------------------------------------------------------------


async def test_32_concurrent_streams(server):
    """32 streamed requests at once all finish with finish_reason 'length' and exactly max_tokens
    tokens, and the engine batched them (a decode batch of more than one row)."""
    max_tokens = 16
    sizes_before = settled(lambda: server.replica_status()["stats"]["decode_batch_sizes"])
    async with openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEYS["tenant-a"], max_retries=0, timeout=90) as c:

        async def one(i: int) -> tuple[str, str | None, int]:
            stream = await c.completions.create(
                model=MODEL,
                prompt=f"request number {i}",
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return text, finish, usage

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=90)
    assert len(results) == 32
    assert [(finish, usage) for _, finish, usage in results] == [("length", max_tokens)] * 32
    assert all(text for text, _, _ in results)

    def batched() -> bool:
        sizes = server.replica_status()["stats"]["decode_batch_sizes"]
        grown = {int(k): n - sizes_before.get(k, 0) for k, n in sizes.items() if n > sizes_before.get(k, 0)}
        return sum(k * n for k, n in grown.items()) >= 32 * (max_tokens - 1) and max(grown) > 1

    wait_for(batched, 10, what="the burst's decode steps, batched")


def test_client_disconnect_aborts_request(server):
    """A client that goes away mid-stream cancels its request in the engine: the replica counts an
    'abort', stops generating for it, and keeps serving."""
    status = settled(server.replica_status, timeout=15)
    aborts = status["stats"]["finished_requests"].get("abort", 0)
    generated = status["stats"]["generated_tokens"]
    cancelled = requests_counted(status, "tenant-b", "cancelled")
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": LONG, "temperature": 0, "stream": True}
    seen = []
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body, headers=server.key_headers("tenant-b")) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(line)
                if len(seen) == 2:
                    break
        # leaving both blocks closes the connection with the stream unread
    assert all('"finish_reason": null' in line for line in seen), seen

    after = wait_for(
        lambda: (s := server.replica_status())["stats"]["finished_requests"].get("abort", 0) >= aborts + 1 and s,
        10,
        what="the replica to count the disconnected request as 'abort'",
    )
    assert after["stats"]["generated_tokens"] - generated < LONG  # it was stopped, not run to the end
    wait_for(
        lambda: requests_counted(server.replica_status(), "tenant-b", "cancelled") == cancelled + 1,
        10,
        what="the replica to count tenant-b's request as cancelled",
    )

    r = server.complete("tenant-b", max_tokens=5)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


# -- gradual rollout (last: it leaves a finished rollout at 100%) ------------------------------------


def rollout_call(server, method: str, path: str, operator: str = "alice", body: dict | None = None):
    headers = server.admin_headers(OPERATOR_TOKENS[operator])
    return server.http.request(method, f"/admin/rollouts{path}", json=body, headers=headers)


def test_rollout_through_the_admin_api(server):
    """A rollout by request at 50%: plans are validated, one runs at a time, requests outside the
    cohort decode as rollout_holdback and the others as before, the rollout survives a controller
    restart, operators pause and promote it (audited by name), and /metrics shows it."""
    assert rollout_call(server, "GET", "/current").status_code == 404
    bad = rollout_call(server, "POST", "", body={"steps": [{"percent": 50}, {"percent": 10}]})
    assert bad.status_code == 400 and "steps" in bad.json()["detail"]
    assert rollout_call(server, "POST", "", body={"steps": [{"percent": 50}], "unit": "gpu"}).status_code == 400
    plan = {
        "steps": [{"percent": 50, "hold_s": 3600}, {"percent": 100}],
        "unit": "request",
        "guards": {"min_samples": 100000, "interval_s": 0.5},
    }
    started = rollout_call(server, "POST", "", body=plan)
    assert started.status_code == 201, started.text
    rollout = started.json()
    assert (rollout["phase"], rollout["percent"], rollout["step"]) == ("Progressing", 50, 0)
    assert rollout_call(server, "POST", "", operator="bob", body=plan).status_code == 409

    def split_traffic() -> bool:
        before = settled(
            lambda: (rows(server.replica_status(), "rollout_holdback"), rows(server.replica_status(), "unavailable"))
        )
        for _ in range(8):
            assert server.complete("tenant-a", max_tokens=SHORT).status_code == 200
        after = settled(
            lambda: (rows(server.replica_status(), "rollout_holdback"), rows(server.replica_status(), "unavailable"))
        )
        return after[0] > before[0] and after[1] > before[1]

    wait_for(split_traffic, 60, interval=0, what="requests to split between the cohort and the holdback")
    current = wait_for(
        lambda: (r := rollout_call(server, "GET", "/current").json())["signals"]["graph"]["requests"] and r,
        30,
        what="cohort signals to reach the controller",
    )
    assert current["signals"]["holdback"]["requests"] > 0 and current["phase"] == "Progressing"
    assert {g["guard"]: g["verdict"] for g in current["guards"]}["error_rate"] == "inconclusive"

    actor = controller(server)
    pid = _pid(actor)
    ray.kill(actor, no_restart=False)
    wait_for(lambda: _pid(actor, timeout=2) != pid, 60, what="the controller to restart")
    resumed = rollout_call(server, "GET", "/current").json()
    assert (resumed["id"], resumed["phase"], resumed["step"]) == (rollout["id"], "Progressing", 0)

    assert rollout_call(server, "POST", "/current/pause").json()["phase"] == "Paused"
    assert rollout_call(server, "POST", "/current/pause").status_code == 409
    assert rollout_call(server, "POST", "/current/rewind").status_code == 404
    promoted = rollout_call(server, "POST", "/current/promote", operator="bob").json()
    assert (promoted["phase"], promoted["percent"]) == ("Succeeded", 100)
    assert rollout_call(server, "POST", "/current/abort").status_code == 409  # it has ended
    entries = [a for a in audit(server) if a["action"] == "rollout" and a["rollout_id"] == rollout["id"]]
    assert [a["actor"] for a in entries] == ["alice", "alice", "alice", "bob", "bob"]
    assert {a["client"] for a in entries} == {"127.0.0.1"}  # operators' calls, each with its address
    latest = server.http.get("/admin/audit?limit=2", headers=server.admin_headers()).json()["audit"]
    assert latest == entries[-2:]
    assert server.http.get("/admin/audit?limit=0", headers=server.admin_headers()).status_code == 400

    text = server.http.get("/metrics").text
    assert "graphserve_rollout_percent 100.0" in text and 'graphserve_rollout_phase{phase="Succeeded"} 1.0' in text
    wait_for(lambda: decodes_as(server, "tenant-a", "unavailable"), 60, interval=0, what="all requests in the cohort")


def test_a_shadow_mismatch_reported_to_the_controller_rolls_back(server):
    """The decision loop of the real controller actor, fed through its real report path: a replica
    status whose shadow verification found a mismatch rolls a running rollout back within a few
    intervals, the audit names the controller and the mismatch, and every request is then held
    back (0%) until a new rollout goes to 100%."""
    actor = controller(server)
    fake = "replica-under-test"
    status = {"state": "READY", "stats": {"shadow": {"checks": 10, "mismatches": 0, "last_mismatch": None}}}
    ray.get(actor.report.remote(fake, status), timeout=30)
    plan = {
        "steps": [{"percent": 50, "hold_s": 3600}, {"percent": 100}],
        "unit": "request",
        "guards": {"interval_s": 0.2},
    }
    started = rollout_call(server, "POST", "", body=plan)
    assert started.status_code == 201, started.text
    try:
        mismatch = {
            "checks": 11,
            "mismatches": 1,
            "last_mismatch": "decode_bs_8: max |graph - eager| = 0.5 over 3 rows",
        }
        reported = time.monotonic()
        ray.get(actor.report.remote(fake, {**status, "stats": {"shadow": mismatch}}), timeout=30)
        current = wait_for(
            lambda: (r := rollout_call(server, "GET", "/current").json())["phase"] == "RolledBack" and r,
            10,
            what="the rollout to roll back",
        )
        assert time.monotonic() - reported < 5
    finally:
        ray.get(actor.__ray_call__.remote(lambda self: self.replicas.pop(fake, None)), timeout=30)
    assert current["percent"] == 0 and "decode_bs_8" in current["reason"]
    last = audit(server)[-1]
    assert (last["actor"], last["phase"]) == ("controller", "RolledBack") and "mismatch" in last["reason"]
    wait_for(lambda: decodes_as(server, "tenant-a", "rollout_holdback"), 60, interval=0, what="every request held back")
    assert rollout_call(server, "POST", "", body={"steps": [{"percent": 100}]}).json()["phase"] == "Succeeded"
    wait_for(lambda: decodes_as(server, "tenant-a", "unavailable"), 60, interval=0, what="graphs for all again")
