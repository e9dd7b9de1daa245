"""Helpers for the CPU integration tests: start a real Ray Serve application on 127.0.0.1 and talk
to it. Each test module starts ONE Ray instance through `running_app` (in a module-scoped fixture),
runs the graphserve application there with fractional CPUs, a tmp controller state file and a
controller name of its own, and shuts Ray down afterwards. Secrets go into the environment before
`ray.init`, so the Ray worker processes inherit them.

Run under Ray Serve's throughput-optimized mode (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1` in pytest's
environment), the tests talk to the ingress replica's own HTTP server, as a client of that mode
does, not to Serve's proxy; with `RAY_SERVE_ENABLE_HA_PROXY=1` as well, to HAProxy on the usual
port, which forwards to those servers."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

try:
    import httpx
except ImportError:  # recent openai clients ship the same API as `httpx2`
    import httpx2 as httpx

API_KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
API_KEYS_ENV = ",".join(f"{tenant}:{key}" for tenant, key in API_KEYS.items())
READY_TIMEOUT_S = 60.0

# Every admin route, with a body where it takes one.
ADMIN_CALLS = [
    ("GET", "/admin/tenants/tenant-a/cuda-graph", None),
    ("PUT", "/admin/tenants/tenant-a/cuda-graph", {"cuda_graph": False}),
    ("GET", "/admin/status", None),
    ("GET", "/admin/audit", None),
    ("POST", "/admin/rollouts", {"steps": [{"percent": 100}]}),
    ("GET", "/admin/rollouts/current", None),
    ("POST", "/admin/rollouts/current/abort", None),
    ("POST", "/admin/model", {"model": "/nonexistent"}),
    ("GET", "/admin/model", None),
    ("PUT", "/admin/graph-policy", {"mode": "eager"}),
    ("GET", "/admin/buckets/recommendation?max_buckets=4", None),
]
ADMIN_CALL_IDS = [
    "get-toggle",
    "put-toggle",
    "status",
    "audit",
    "start-rollout",
    "get-rollout",
    "abort-rollout",
    "start-swap",
    "get-model",
    "put-graph-policy",
    "bucket-recommendation",
]

# Small enough for 2 cores and 24 GiB: one replica, fractional CPUs, short contexts.
BASE_ARGS: dict[str, Any] = {
    "replica_num_cpus": 0.5,
    "ingress_num_cpus": 0.25,
    "max_model_len": 256,
    "autoscaling": {"min_replicas": 1, "max_replicas": 1},
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct_ingress_port(app_name: str, timeout: float = READY_TIMEOUT_S) -> int:
    """The HTTP port of the app's ingress replica under direct ingress (from the Serve controller's
    target groups, once the replica serves)."""
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller

    def port() -> int | None:
        for group in ray.get(controller.get_target_groups.remote(app_name)):
            if group.protocol == RequestProtocol.HTTP and group.ingress_deployment_name and group.targets:
                return group.targets[0].port
        return None

    return wait_for(port, timeout, interval=0.2, what=f"app {app_name}'s ingress replica serving HTTP")


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.25, what: str = "condition") -> Any:
    """Poll until `predicate()` is truthy and return its value; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - keep polling, report the last error on timeout
            last_error = e
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout:.0f}s waiting for {what}" + (f": {last_error!r}" if last_error else "")
            )
        time.sleep(interval)


def settled(read: Callable[[], Any], settle_s: float = 1.6, timeout: float = 20.0) -> Any:
    """A value read again after `settle_s` (longer than a replica's status period) without changing:
    everything sent before has been reported."""
    deadline = time.monotonic() + timeout
    value = read()
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        again = read()
        if again == value:
            return value
        value = again
    pytest.fail(f"value still changing after {timeout:.0f}s: {value!r}")


def assert_openai_error(response: httpx.Response, status: int, *needles: str) -> dict:
    """The body is OpenAI's error shape with a non-empty message mentioning every needle."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    for needle in needles:
        assert needle.lower() in error["message"].lower(), (needle, error["message"])
    return error


@dataclass
class Server:
    """A running graphserve application and the knobs the tests need to reach it."""

    port: int
    args: dict[str, Any]
    admin_token: str | None
    model: str
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.base_url, timeout=60.0)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    @property
    def controller_name(self) -> str:
        return self.args["controller_name"]

    @property
    def controller_namespace(self) -> str:
        return self.args.get("controller_namespace", "graphserve")

    def admin_headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.admin_token}"}

    @staticmethod
    def key_headers(tenant: str = "tenant-a") -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEYS[tenant]}"}

    def complete(self, tenant: str = "tenant-a", **body: Any) -> httpx.Response:
        payload = {"model": self.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, **body}
        return self.http.post("/v1/completions", json=payload, headers=self.key_headers(tenant))

    def admin_status(self) -> dict:
        r = self.http.get("/admin/status", headers=self.admin_headers())
        assert r.status_code == 200, r.text
        return r.json()

    def replica_status(self) -> dict:
        """The one LLM replica's last reported status (autoscaling is pinned to one replica), less
        its report time, so that two reads with nothing new in between compare equal."""
        replicas = self.admin_status()["replicas"]
        assert len(replicas) == 1, list(replicas)
        status = dict(next(iter(replicas.values())))
        status.pop("reported_at", None)
        return status

    def is_ready(self) -> bool:
        try:
            return self.http.get("/readyz", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        wait_for(self.is_ready, timeout, interval=0.5, what="GET /readyz == 200")

    def close(self) -> None:
        self.http.close()


@contextlib.contextmanager
def running_app(
    tmp_path: Path,
    *,
    name: str,
    args: dict[str, Any] | None = None,
    admin_token: str | None = None,
    extra_env: dict[str, str] | None = None,
    wait_until_running: bool = True,
    before_deploy: Callable[[dict[str, Any]], None] | None = None,
) -> Iterator[Server]:
    """Start Ray (one instance for the calling module) and Serve on a free port, run the app, yield
    a `Server`; tear everything down afterwards. With wait_until_running=False the call returns as
    soon as the app is submitted (its replicas may still be starting). before_deploy(app_args) runs
    once Ray and Serve are up, before the app is deployed."""
    import ray
    from ray import serve

    from app import deployment

    if ray.is_initialized():  # a previous module's teardown did not run: never share state
        ray.shutdown()
    (tmp_path / "cache").mkdir(parents=True, exist_ok=True)
    env = {
        "GRAPHSERVE_API_KEYS": API_KEYS_ENV,
        "GRAPHSERVE_CACHE": str(tmp_path / "cache"),
        **(extra_env or {}),
    }
    app_args = {
        **BASE_ARGS,
        "controller_state_path": str(tmp_path / "controller-state.json"),
        "controller_name": f"graphserve-it-{name}-{uuid.uuid4().hex[:8]}",
        **(args or {}),
    }
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("GRAPHSERVE_ADMIN_TOKENS", raising=False)  # a developer's shell must not leak into a test
        for key, value in env.items():
            mp.setenv(key, value)
        if admin_token is None:
            mp.delenv("GRAPHSERVE_ADMIN_TOKEN", raising=False)
        else:
            mp.setenv("GRAPHSERVE_ADMIN_TOKEN", admin_token)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        server = None
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            if before_deploy is not None:
                before_deploy(app_args)
            application = deployment(app_args)
            if wait_until_running:
                serve.run(application, blocking=False, name=f"graphserve-{name}")
            else:
                # serve.run waits for every replica to finish __init__ (graph capture); the startup
                # gate test needs the app reachable while its LLM replica is still starting.
                serve._run(application, name=f"graphserve-{name}", _blocking=False)
            if (
                os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"
                and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1"
            ):
                port = direct_ingress_port(f"graphserve-{name}")
            model = app_args.get("served_model_name") or "tiny-llama-v1"
            server = Server(port=port, args=app_args, admin_token=admin_token, model=model)
            yield server
        finally:
            if server is not None:
                server.close()
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()


@contextlib.contextmanager
def openai_client(server: Server, tenant: str = "tenant-a") -> Iterator[Any]:
    """The real `openai` client against the app, as a tenant, without retries (a test sees every answer)."""
    import openai

    with openai.OpenAI(base_url=server.v1, api_key=API_KEYS[tenant], max_retries=0, timeout=60) as client:
        yield client


def sse_events(lines: list[str]) -> list[str]:
    """The `data:` payloads of an SSE stream, in order."""
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def json_events(lines: list[str]) -> list[dict]:
    return [json.loads(p) for p in sse_events(lines) if p != "[DONE]"]


def write_slow_checkpoint(path: Path, seed: int = 7) -> Path:
    """A random Llama about 400x the embedded tiny one (hidden 512, 12 layers: ~10 ms per decode
    step on one CPU thread), with the byte-level tokenizer and its EOS logit pinned to 0 so greedy
    decoding never ends early. Streams of a couple of hundred tokens then last seconds, long enough
    to disconnect from one mid-flight; the tiny model finishes 250 tokens in ~0.1 s."""
    from safetensors.torch import load_file, save_file

    from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint

    tokenizer = build_byte_tokenizer()
    hidden = 512
    config = {
        **tiny_hf_config(len(tokenizer)),
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": 12,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 128,
        "head_dim": 64,
    }
    write_checkpoint(path, config, tokenizer, seed=seed)
    weights = path / "model.safetensors"
    state = load_file(weights)
    state["lm_head.weight"][config["eos_token_id"]] = 0.0
    save_file(state, weights, metadata={"format": "pt"})
    return path
