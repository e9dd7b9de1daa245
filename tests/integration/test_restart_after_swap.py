"""A restart serves the model it was configured with (real Ray Serve, one state file, the app
deployed three times): a swap's target persists for the same configuration, but one that no
longer passes the gate is not served (the replica falls back to the configured model, saying
why), and a deployment with another configured model archives the old swap state instead of
serving it under the new model's name. `/v1/models` and `/admin/model` name what the replica
actually loaded."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest
import ray
from ray import serve

from tests.integration.helpers import running_app, wait_for
from tests.integration.test_model_swap import MAX_MODEL_LEN, engine_alone, write_checkpoints

pytestmark = pytest.mark.timeout(300)
NAME = "restart"
APP = f"graphserve-{NAME}"
ADMIN_TOKEN = "admin-" + uuid.uuid4().hex
PROMPTS = ["Hello", "The capital of", "1 2 3"]


def app_args(model, state_path) -> dict:
    return {"model": str(model), "max_model_len": MAX_MODEL_LEN, "controller_state_path": str(state_path)}


def texts(server, name: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        r = server.complete(model=name, prompt=prompt, max_tokens=8, ignore_eos=True)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def get(server, route: str, admin: bool = True) -> dict:
    r = server.http.get(route, headers=server.admin_headers() if admin else server.key_headers())
    assert r.status_code == 200, r.text
    return r.json()


def the_replica(server) -> dict:
    """The one replica /admin/model lists (the replaced one leaves it as Serve stops it)."""
    wait_for(lambda: len(get(server, "/admin/model")["replicas"]) == 1, 15, what="one replica in /admin/model")
    (replica,) = get(server, "/admin/model")["replicas"].values()
    return replica


def redeploy(server, model, restart_controller: bool) -> None:
    """Deploy the app again with `model` configured (Serve replaces its replicas); with
    restart_controller the app is deleted first and the detached controller restarted (it reads the
    state file again), as after a restart of the whole deployment."""
    from app import deployment

    if restart_controller:
        serve.delete(APP)
        ray.kill(ray.get_actor(server.controller_name, namespace=server.controller_namespace), no_restart=False)
    server.args["model"] = str(model)
    serve.run(deployment(server.args), blocking=False, name=APP)
    server.wait_ready(120)


def test_restarts_serve_what_the_configuration_asks_for(tmp_path):
    paths = write_checkpoints(tmp_path)
    state = tmp_path / "controller-state.json"
    with running_app(tmp_path, name=NAME, args=app_args(paths["v1"], state), admin_token=ADMIN_TOKEN) as s:
        s.wait_ready()
        r = s.http.post("/admin/model", json={"model": str(paths["v2"])}, headers=s.admin_headers())
        assert r.status_code == 202, r.text
        wait_for(lambda: get(s, "/admin/model")["swap"]["phase"] == "Succeeded", 120, what="the swap to v2")

        # v2 no longer passes the gate (its weights turned NaN): the same configuration starts on v1.
        shutil.copy(paths["nan"] / "model.safetensors", paths["v2"] / "model.safetensors")
        redeploy(s, paths["v1"], restart_controller=True)
        replica = the_replica(s)
        assert replica["model"] == str(paths["v1"]), replica
        assert replica["model_fallback"]["target"]["model"] == str(paths["v2"])
        assert "not finite" in replica["model_fallback"]["reason"]
        (card,) = get(s, "/v1/models", admin=False)["data"]
        assert (card["id"], card["root"]) == ("v1", str(paths["v1"]))
        assert texts(s, "v1") == engine_alone(paths["v1"])
        wait_for(
            lambda: any(a["action"] == "model_fallback" for a in get(s, "/admin/audit")["audit"]),
            10,
            what="the fallback in the audit log",
        )
        assert not any(a["action"] == "archive_swap_state" for a in get(s, "/admin/audit")["audit"])

        # Another configured model (a config update; the controller lives on): the swap state made
        # for v1 is archived, and "wide" serves wide.
        redeploy(s, paths["wide"], restart_controller=False)
        assert the_replica(s)["model"] == str(paths["wide"]) and the_replica(s)["model_fallback"] is None
        (card,) = get(s, "/v1/models", admin=False)["data"]
        assert (card["id"], card["root"]) == ("wide", str(paths["wide"]))
        assert texts(s, "wide") == engine_alone(paths["wide"])
        assert get(s, "/admin/model")["swap"] is None
        (entry,) = [a for a in get(s, "/admin/audit")["audit"] if a["action"] == "archive_swap_state"]
        assert entry["serving_model"]["model"] == str(paths["v2"]) and "model" in entry["reason"]
    archived = json.loads(state.read_text())["archived"]
    assert archived[0]["serving_model"]["model"] == str(paths["v2"]) and archived[0]["swap"]["id"] == "swap-1"
