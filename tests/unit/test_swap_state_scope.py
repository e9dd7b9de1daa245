"""The controller's swap state belongs to one deployment (no Ray): it records the configuration it
was made for; a restart with another configured model (or revision, or graph policy) archives the
stale swap target and swap record instead of serving them, with an audit entry, while toggles
survive; a replica that starts during a swap joins it, and one gone before its turn leaves it."""

from __future__ import annotations

import json
import logging
import time

from app.auth import Operator
from app.config import AppConfig
from app.controller import GraphController
from policies.model_swap import SwapPhase

A = AppConfig(model="/ckpts/a").made_for()
FRESH = AppConfig(model="/ckpts/fresh").made_for()


def swapped_to_b(path: str) -> GraphController:
    """A controller of deployment A whose swap to /ckpts/b succeeded, with a tenant toggled off."""
    c = GraphController(path, {}, A)
    c.set_toggle("tenant-a", False, Operator("alice"))
    c.report("r1", {"state": "READY"})
    c.start_swap("model", {"model": "/ckpts/b", "revision": "b"}, {"model": "/ckpts/a"}, Operator("alice"))
    c.report("r1", {"state": "READY", "swap": {"id": "swap-1", "step": "serving", "path": "in_place"}})
    assert c.swap.phase == SwapPhase.SUCCEEDED
    return c


def test_the_same_deployment_restarted_serves_its_swap_target(tmp_path):
    path = str(tmp_path / "state.json")
    swapped_to_b(path)
    again = GraphController(path, {}, A)
    assert again.adopt(A, "replica r2") == {"model": "/ckpts/b", "revision": "b"}
    assert again.toggles == {"tenant-a": False} and again.archived == []


def test_another_configured_model_wins_and_the_stale_target_is_archived(tmp_path, caplog):
    path = str(tmp_path / "state.json")
    swapped_to_b(path)
    caplog.set_level(logging.WARNING, logger="app.controller")
    fresh = GraphController(path, {}, FRESH)
    assert fresh.adopt(FRESH, "replica r9") is None  # the configured model, not b
    assert fresh.swap is None and fresh.current_swap() is None
    assert fresh.toggles == {"tenant-a": False}  # the tenant's toggle is the deployment's, not the model's
    (archived,) = fresh.archived
    assert archived["serving_model"] == {"model": "/ckpts/b", "revision": "b"}
    assert archived["swap"]["id"] == "swap-1" and archived["made_for"]["model"] == "/ckpts/a"
    assert "model changed" in archived["reason"]
    entry = fresh.audit[-1]
    assert entry["action"] == "archive_swap_state" and entry["serving_model"]["model"] == "/ckpts/b"
    assert "archived" in caplog.text and "/ckpts/fresh" in caplog.text
    on_disk = json.loads((tmp_path / "state.json").read_text())
    assert on_disk["serving_model"] is None and on_disk["made_for"]["model"] == "/ckpts/fresh"
    assert on_disk["archived"][0]["serving_model"]["model"] == "/ckpts/b"  # kept aside, not deleted
    assert GraphController(path, {}, FRESH).archived == fresh.archived  # archived once, not at every start


def test_a_running_controller_archives_when_a_replica_of_a_new_configuration_starts(tmp_path):
    """A detached controller outlives a config change on a long-lived cluster: the first replica
    of the new configuration makes it archive, in memory and on disk."""
    c = swapped_to_b(str(tmp_path / "state.json"))
    assert c.adopt(FRESH, "replica r9", "r9") is None
    assert c.serving_model is None and c.archived[0]["serving_model"]["model"] == "/ckpts/b"


def test_a_graph_policy_change_in_the_configuration_archives_too(tmp_path):
    path = str(tmp_path / "state.json")
    swapped_to_b(path)
    eager = AppConfig(model="/ckpts/a", cuda_graph_policy={"mode": "eager"}).made_for()
    c = GraphController(path, {}, eager)
    assert c.serving_model is None and "graph_policy changed" in c.archived[0]["reason"]


def test_a_state_file_that_does_not_say_what_it_was_made_for_is_not_trusted(tmp_path):
    """A file written before this record existed (the old shared default path)."""
    path = tmp_path / "state.json"
    legacy = {"toggles": {"tenant-a": False}, "audit": [], "version": 3, "serving_model": {"model": "/ckpts/b"}}
    path.write_text(json.dumps(legacy))
    c = GraphController(str(path), {}, FRESH)
    assert c.serving_model is None and c.toggles == {"tenant-a": False}
    assert "does not say" in c.archived[0]["reason"]


def test_adapters_registered_for_another_model_are_archived_with_it(tmp_path):
    path = str(tmp_path / "state.json")
    c = GraphController(path, {}, A)
    c.add_lora_adapter("sql", "/adapters/sql-for-a", Operator("alice"))
    assert GraphController(path, {}, A).lora_adapters.keys() == {"sql"}
    fresh = GraphController(path, {}, FRESH)
    assert fresh.lora_adapters == {} and fresh.archived[0]["lora_adapters"]["sql"]["path"] == "/adapters/sql-for-a"


def test_state_paths_and_controller_names_are_per_deployment():
    a = AppConfig(model="/ckpts/a").for_app("default")
    fresh = AppConfig(model="/ckpts/fresh").for_app("default")
    other_app = AppConfig(model="/ckpts/a").for_app("chat app")
    assert len({a.controller_state_path, fresh.controller_state_path, other_app.controller_state_path}) == 3
    assert len({a.controller_name, fresh.controller_name, other_app.controller_name}) == 3
    assert " " not in other_app.controller_state_path and a.controller_state_path.endswith("default.a.json")
    named = AppConfig(model="/ckpts/a", served_model_name="llama").for_app("default")
    assert named.controller_name == "graphserve-controller.default.llama"
    explicit = AppConfig(controller_state_path="/var/lib/graphserve/s.json", controller_name="c").for_app("x")
    assert (explicit.controller_state_path, explicit.controller_name) == ("/var/lib/graphserve/s.json", "c")


def test_a_replica_starting_during_a_swap_joins_it_and_the_swap_waits_for_it(tmp_path):
    c = GraphController(str(tmp_path / "state.json"), {}, A)
    for r in ("r1", "r2"):
        c.report(r, {"state": "READY"})
    c.start_swap("model", {"model": "/ckpts/b"}, {"model": "/ckpts/a"}, Operator("alice"))
    assert c.adopt(A, "replica r3", "r3") is None  # it loads the previous model ...
    assert c.swap.order == ["r1", "r2", "r3"]  # ... and swaps in its turn
    for r in ("r1", "r2"):
        c.report(r, {"state": "READY", "swap": {"id": "swap-1", "step": "serving"}})
    assert c.swap.phase == SwapPhase.PROGRESSING and c._swap_order()["now"] == ["r3"]
    c.report("r3", {"state": "READY", "swap": {"id": "swap-1", "step": "serving"}})
    assert c.swap.phase == SwapPhase.SUCCEEDED and c.serving_model == {"model": "/ckpts/b", "revision": None}
    assert c.adopt(A, "replica r4", "r4") == {"model": "/ckpts/b", "revision": None}  # after: the new model
    assert "r4" not in c.swap.replicas


def test_replicas_still_starting_when_a_swap_begins_are_in_its_order(tmp_path):
    c = GraphController(str(tmp_path / "state.json"), {}, A)
    c.report("r1", {"state": "READY"})
    c.report("r2", {"state": "STARTING"})
    c.report("r3", {"state": "FAILED"})
    swap = c.start_swap("model", {"model": "/ckpts/b"}, {"model": "/ckpts/a"}, Operator("alice"))["swap"]
    assert swap["order"] == ["r1", "r2"]


def test_a_replica_gone_before_its_turn_leaves_the_swap(tmp_path):
    c = GraphController(str(tmp_path / "state.json"), {}, A)
    for r in ("r1", "r2"):
        c.report(r, {"state": "READY"})
    c.start_swap("model", {"model": "/ckpts/b"}, {"model": "/ckpts/a"}, Operator("alice"))
    c.report("r1", {"state": "READY", "swap": {"id": "swap-1", "step": "serving"}})
    c.replicas["r2"]["reported_at"] -= 60  # r2 died while waiting
    c.check_swap(now=time.time())
    assert c.swap.order == ["r1"] and c.swap.phase == SwapPhase.SUCCEEDED


def test_a_replica_falling_back_from_the_persisted_target_is_audited_once(tmp_path):
    c = GraphController(str(tmp_path / "state.json"), {}, A)
    fallback = {"target": {"model": "/ckpts/b"}, "reason": "CheckpointError: /ckpts/b: no tokenizer files"}
    for _ in range(3):
        c.report("r1", {"state": "READY", "model": "/ckpts/a", "model_fallback": fallback})
    entries = [a for a in c.audit if a["action"] == "model_fallback"]
    assert len(entries) == 1 and entries[0]["replica"] == "r1" and "no tokenizer" in entries[0]["reason"]
