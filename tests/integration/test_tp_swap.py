"""Model swaps on a tensor-parallel replica (real Ray Serve, tensor_parallel_size 2, gloo on CPU):
a checkpoint of the same shapes loads in place on both ranks, a NaN one fails the gate and both
ranks serve the old weights again, a checkpoint of other shapes rebuilds both shard actors, and a
graph-policy change rebuilds them too. After each, the replica's tokens equal those of a fresh
single-process engine on the checkpoint it should serve: a rank left on other weights would not."""

from __future__ import annotations

import uuid

import pytest

from tests.integration.helpers import running_app, wait_for
from tests.integration.test_model_swap import MAX_MODEL_LEN, MODEL, engine_alone, served, write_checkpoints
from tests.integration.test_tp_app import shard_actors

pytestmark = pytest.mark.timeout(300)
ADMIN_TOKEN = "admin-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-swap")
    paths = write_checkpoints(tmp)
    args = {
        "model": str(paths["v1"]),
        "served_model_name": MODEL,
        "model_revision": "v1",
        "accelerator": "cpu",
        "tensor_parallel_size": 2,
        "shard_num_cpus": 0.5,
        "max_model_len": MAX_MODEL_LEN,
    }
    with running_app(tmp, name="tpswap", args=args, admin_token=ADMIN_TOKEN) as server:
        server.wait_ready(120)
        yield server, paths


def swap(server, method: str, route: str, body: dict) -> dict:
    r = server.http.request(method, route, json=body, headers=server.admin_headers())
    assert r.status_code == 202, r.text
    return wait_for(
        lambda: (s := model_view(server)["swap"])["phase"] != "Progressing" and s,
        240,
        interval=0.2,
        what="the swap to finish",
    )


def model_view(server) -> dict:
    r = server.http.get("/admin/model", headers=server.admin_headers())
    assert r.status_code == 200, r.text
    return r.json()


def replica_path(finished: dict) -> str:
    (progress,) = finished["replicas"].values()
    return progress["path"]


def test_in_place_swap_on_every_rank(app):
    server, paths = app
    assert served(server) == engine_alone(paths["v1"])
    finished = swap(server, "POST", "/admin/model", {"model": str(paths["v2"]), "revision": "v2"})
    assert finished["phase"] == "Succeeded", finished
    assert replica_path(finished) == "in_place"
    assert served(server) == engine_alone(paths["v2"])
    (replica,) = model_view(server)["replicas"].values()
    assert (replica["model"], replica["model_revision"]) == (str(paths["v2"]), "v2")


def test_a_nan_checkpoint_reverts_both_ranks(app):
    server, paths = app
    finished = swap(server, "POST", "/admin/model", {"model": str(paths["nan"]), "revision": "nan"})
    assert finished["phase"] == "Failed" and "not finite" in finished["reason"], finished
    (replica,) = model_view(server)["replicas"].values()
    assert replica["model_revision"] == "v2" and replica["state"] == "READY"
    assert served(server) == engine_alone(paths["v2"])  # rank 1 put its old shard back as well


def test_a_checkpoint_of_other_shapes_rebuilds_every_shard(app):
    server, paths = app
    finished = swap(server, "POST", "/admin/model", {"model": str(paths["wide"])})
    assert finished["phase"] == "Succeeded", finished
    assert replica_path(finished) == "rebuild"
    wait_for(lambda: len(shard_actors()) == 2, 30, what="the old shard actors to be gone")
    assert served(server) == engine_alone(paths["wide"])
    (status,) = server.admin_status()["replicas"].values()
    assert [s["rank"] for s in status["shards"]] == [0, 1]


def test_a_graph_policy_change_rebuilds_at_tp(app):
    server, paths = app
    finished = swap(server, "PUT", "/admin/graph-policy", {"mode": "eager", "decode_batch_buckets": [1, 2]})
    assert finished["phase"] == "Succeeded", finished
    assert replica_path(finished) == "rebuild"
    assert served(server) == engine_alone(paths["wide"])
