"""A replica whose controller cannot be reached still starts and becomes READY, with the config's
tenant toggles (tenant-b's graphs off), and syncs with the controller once it is back. The outage is
real: an actor of the controller's class is registered under the controller's name first, asking
for a resource no node has, so it is never placed and every call to it waits (as during a restart
on a lost node); killing it lets the app create the real controller."""

from __future__ import annotations

import pytest
import ray
from ray import serve

from app.controller import GraphController
from tests.integration.helpers import running_app, settled, wait_for
from workers.protocol import GenerateRequest, Item, decode_item, encode
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)
APP = "outage"
ARGS = {"tenants": {"tenant-b": {"cuda_graph": False}}, "controller_timeout_s": 2.0}
placeholder = {}


def register_unplaceable_controller(app_args: dict) -> None:
    placeholder["actor"] = (
        ray.remote(GraphController)
        .options(
            name=app_args["controller_name"],
            namespace="graphserve",
            lifetime="detached",
            resources={"no-such-node": 1},
            num_cpus=0,
        )
        .remote(app_args["controller_state_path"], {})
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_app(
        tmp_path_factory.mktemp(APP),
        name=APP,
        args=ARGS,
        admin_token="admin-outage",
        before_deploy=register_unplaceable_controller,
    ) as s:
        yield s


def llm_handle():
    """A handle this (synchronous) test can call: under Serve's throughput-optimized mode a
    handle's router runs in its caller's event loop unless told otherwise, and a test has none."""
    handle = serve.get_deployment_handle("LLMReplica", app_name=f"graphserve-{APP}")  # one per app, cached
    if not handle.is_initialized:
        handle._init(_run_router_in_separate_loop=True)
    return handle


def generate(tenant: str) -> list[Item]:
    """One request straight to the replica (the ingress needs the controller to see readiness)."""
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    request = GenerateRequest(tenant, "completion", sampling, max_tokens=4, prompt="Hello")
    return [decode_item(data) for data in llm_handle().options(stream=True).generate.remote(encode(request))]


def disabled_rows() -> int:
    parts = llm_handle().status.remote().result(timeout_s=30)["stats"]["decode_step_parts"]
    return sum(p["rows"] for p in parts if p["fallback_reason"] == "tenant_disabled")


def fallback_rate() -> dict[str, float]:
    return llm_handle().status.remote().result(timeout_s=30)["stats"]["fallback_rate"]


def test_replica_is_ready_and_uses_the_config_toggles_while_the_controller_is_down(server):
    status = llm_handle().status.remote().result(timeout_s=30)
    assert status["state"] == "READY"
    assert server.http.get("/admin/status", headers=server.admin_headers()).status_code == 503
    assert "tenant_disabled" not in fallback_rate()
    items = generate("tenant-b")  # graphs off for tenant-b in the config: decoded eagerly
    assert items[-1].finish_reason == "length" and items[-1].completion_tokens == 4
    wait_for(lambda: fallback_rate().get("tenant_disabled", 0) > 0, 30, what="tenant-b's eager rows reported")


def test_replica_syncs_once_the_controller_is_back(server):
    ray.kill(placeholder["actor"], no_restart=True)
    wait_for(server.is_ready, 60, what="/readyz once the real controller runs")
    assert server.complete(tenant="tenant-a").status_code == 200
    r = server.http.get("/admin/tenants/tenant-b/cuda-graph", headers=server.admin_headers())
    assert r.status_code == 200 and r.json()["cuda_graph"] is False, r.text  # the config's toggle, persisted
    r = server.http.put(
        "/admin/tenants/tenant-a/cuda-graph", json={"cuda_graph": False}, headers=server.admin_headers()
    )
    assert r.status_code == 200, r.text

    before = settled(disabled_rows)  # only tenant-a decodes from here on

    def tenant_a_decoded_eagerly() -> bool:
        """tenant-a's rows count as tenant_disabled only once the replica applied the toggle."""
        generate("tenant-a")
        return disabled_rows() > before

    wait_for(tenant_a_decoded_eagerly, 30, interval=0.5, what="the replica to apply the real controller's toggle")
