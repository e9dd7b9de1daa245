"""The startup gate (no traffic reaches a replica before its graphs are captured) and an app with
the admin API disabled (GRAPHSERVE_ADMIN_TOKEN not set).

One Ray instance for the module, started WITHOUT GRAPHSERVE_ADMIN_TOKEN in its environment. The LLM
replica takes `startup_delay_s` extra in `__init__` (the capture phase, as a slow GPU capture would),
and the app is submitted without waiting for it, so the first test sees it while it starts. With the
admin API off, the replica's status is read from the controller actor directly (the same data
/admin/status returns).
"""

from __future__ import annotations

import openai
import pytest
import ray

from tests.integration.helpers import (
    ADMIN_CALL_IDS,
    ADMIN_CALLS,
    API_KEYS,
    assert_openai_error,
    running_app,
    settled,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)

STARTUP_DELAY_S = 10.0
AFTER_READY = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = {"startup_delay_s": STARTUP_DELAY_S}
    with running_app(
        tmp_path_factory.mktemp("gate"), name="gate", args=args, admin_token=None, wait_until_running=False
    ) as s:
        yield s


def replica_statuses(server) -> dict[str, dict]:
    actor = ray.get_actor(server.controller_name, namespace=server.controller_namespace)
    return ray.get(actor.replica_statuses.remote(), timeout=30)


def requests_counted(server) -> int:
    (status,) = replica_statuses(server).values()
    return sum(r["count"] for r in status["requests"]["requests"])


def test_requests_refused_until_capture_done(server):
    """While the replica captures: /readyz and /v1 answer 503 with Retry-After (OpenAI error JSON
    on /v1) and nothing reaches the replica. Once READY: /readyz 200, requests served, and the
    replica's request counter holds exactly the requests sent after READY."""
    wait_for(
        lambda: server.http.get("/healthz", timeout=5).status_code == 200,
        60,
        interval=0.2,
        what="the ingress to answer /healthz",
    )

    r = server.http.get("/readyz")
    assert r.status_code == 503, f"the replica was READY before the ingress answered: raise STARTUP_DELAY_S ({r.text})"
    assert int(r.headers["retry-after"]) > 0

    refused = 0
    for path, body in (
        ("/v1/completions", {"model": server.model, "prompt": "Hello", "max_tokens": 4}),
        ("/v1/chat/completions", {"model": server.model, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = server.http.post(path, json=body, headers=server.key_headers())
        error = assert_openai_error(r, 503)
        assert error["type"] == "service_unavailable"
        assert int(r.headers["retry-after"]) > 0
        refused += 1
    with openai.OpenAI(base_url=server.v1, api_key=API_KEYS["tenant-b"], max_retries=0, timeout=30) as client:
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=server.model, prompt="Hello", max_tokens=4)
        assert info.value.status_code == 503
        refused += 1

    # still starting after all of them: the refusals above all happened before READY
    assert server.http.get("/readyz").status_code == 503
    starting = replica_statuses(server)
    assert all(s["state"] != "READY" for s in starting.values()), starting

    server.wait_ready()
    (status,) = replica_statuses(server).values()
    assert status["state"] == "READY"
    startup = status["startup"]  # the replica's own parts of its start, beside the engine's phases
    assert 0 <= startup["controller_s"] < startup["replica_s"] and 0 < startup["engine_start_s"] < startup["replica_s"]
    for i in range(AFTER_READY):
        r = server.complete("tenant-a" if i % 2 else "tenant-b", max_tokens=3)
        assert r.status_code == 200, r.text
    wait_for(lambda: requests_counted(server) >= AFTER_READY, 10, what="the replica to report its requests")
    assert settled(lambda: requests_counted(server)) == AFTER_READY
    assert refused == 3


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS, ids=ADMIN_CALL_IDS)
@pytest.mark.parametrize("authorization", [None, "Bearer some-token", "Bearer"], ids=["none", "a-token", "empty"])
def test_admin_disabled_without_token_env(server, method, path, body, authorization):
    """With no GRAPHSERVE_ADMIN_TOKEN every admin call is refused with a message naming it."""
    headers = {"Authorization": authorization} if authorization else {}
    r = server.http.request(method, path, json=body, headers=headers)
    assert r.status_code == 403, r.text
    assert "GRAPHSERVE_ADMIN_TOKEN" in r.json()["detail"]


def test_admin_disabled_changes_nothing(server):
    """Refused toggle writes leave the controller's toggles and audit log untouched."""
    actor = ray.get_actor(server.controller_name, namespace=server.controller_namespace)
    version, toggles = ray.get(actor.get_toggles.remote(), timeout=30)
    assert version == 0 and all(toggles.values())
    assert ray.get(actor.audit_log.remote(), timeout=30) == []


def test_serving_unaffected_by_disabled_admin(server):
    """The OpenAI API, /readyz and /metrics work while the admin API is off."""
    server.wait_ready()
    assert server.complete(max_tokens=2).status_code == 200
    assert server.http.get("/readyz").status_code == 200
    assert "graphserve_requests_total" in server.http.get("/metrics").text
