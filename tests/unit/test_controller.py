"""The controller's state file (no Ray: GraphController is a plain class until controller_handle
wraps it): a bad file never stops the actor from starting, and a toggle is persisted before it is
applied, so a failed write changes nothing and a retried call audits nothing twice."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app import controller as controller_module
from app.auth import Operator
from app.controller import GraphController

INITIAL = {"tenant-a": True, "tenant-b": False}


def snapshot(c: GraphController) -> tuple:
    return dict(c.toggles), [dict(a) for a in c.audit], c.version


def files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_state_survives_a_restart(tmp_path):
    """What one controller sets, the next one (a restart) reads back, over the config's toggles."""
    path = tmp_path / "state.json"
    first = GraphController(str(path), INITIAL)
    result = first.set_toggle("tenant-a", False, Operator("alice", "10.0.0.1"))
    assert result["cuda_graph"] is False and result["updated_by"] == "alice"
    second = GraphController(str(path), INITIAL)
    assert snapshot(second) == snapshot(first)
    assert second.toggles == {"tenant-a": False, "tenant-b": False}
    assert second.audit[-1] | {"time": 0} == {
        "time": 0,
        "actor": "alice",
        "client": "10.0.0.1",
        "tenant": "tenant-a",
        "action": "set_cuda_graph",
        "before": True,
        "after": False,
    }
    assert files(tmp_path) == {"state.json"}


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"toggles": {"tenant-a": fal', "not valid JSON"),
        ("", "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),
        ("[]", "not a state file"),
        ('"toggles"', "not a state file"),
        ('{"audit": [], "version": 3}', "toggles"),
        ('{"toggles": {"tenant-a": "no"}, "audit": [], "version": 1}', "toggles.tenant-a"),
        ('{"toggles": {}, "audit": [{"tenant": "tenant-a"}], "version": 1}', "audit.0"),
        ('{"toggles": {}, "audit": {}, "version": 1}', "audit"),
        ('{"toggles": {}, "audit": [], "version": -1}', "version"),
        ('{"toggles": {}, "audit": [], "version": "7"}', "version"),
    ],
    ids=[
        "truncated",
        "empty",
        "nested-too-deep",
        "array",
        "string",
        "no-toggles",
        "toggle-not-bool",
        "audit-entry-incomplete",
        "audit-not-list",
        "version-negative",
        "version-string",
    ],
)
def test_a_bad_state_file_is_kept_aside_and_the_config_used(tmp_path, caplog, content, reason):
    """Corrupt JSON or JSON of the wrong shape: the actor starts from the config's toggles (it must
    not crash: with unlimited restarts that is a crash loop), the file is renamed aside with its
    content intact, and the log says why."""
    path = tmp_path / "state.json"
    path.write_text(content)
    with caplog.at_level(logging.ERROR, logger="app.controller"):
        c = GraphController(str(path), INITIAL)
    assert snapshot(c) == (INITIAL, [], 0)
    (aside,) = files(tmp_path)
    assert aside.startswith("state.json.corrupt-")
    assert (tmp_path / aside).read_text() == content
    (record,) = caplog.records
    assert reason in record.getMessage() and aside in record.getMessage()
    # and it works from there: the next write creates a fresh state file
    assert c.set_toggle("tenant-b", True, Operator("bob"))["cuda_graph"] is True
    # a configuration without tenants: tenant-b stays as bob set it (its configured value was False)
    assert GraphController(str(path), {}).toggles == {"tenant-b": True}


def test_a_bad_state_file_that_cannot_be_moved_still_does_not_stop_the_start(tmp_path, caplog, monkeypatch):
    path = tmp_path / "state.json"
    path.write_text("{")

    def refuse(self, target):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "rename", refuse)
    with caplog.at_level(logging.ERROR, logger="app.controller"):
        c = GraphController(str(path), INITIAL)
    assert snapshot(c) == (INITIAL, [], 0)
    assert "could not be renamed aside" in caplog.text


def test_a_failed_write_changes_nothing(tmp_path, monkeypatch):
    """os.replace fails (disk full, storage gone): the caller gets an error, memory, version, audit
    and the file on disk are as before, and no temp file is left behind."""
    path = tmp_path / "state.json"
    c = GraphController(str(path), INITIAL)
    c.set_toggle("tenant-a", False, Operator("alice"))
    before, on_disk = snapshot(c), path.read_text()

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(controller_module.os, "replace", full)
    result = c.set_toggle("tenant-a", True, Operator("bob"))
    assert set(result) == {"error"} and "No space left on device" in result["error"]
    assert snapshot(c) == before
    assert c.get_toggles(before[2]) == (before[2], None)  # replicas see no new version
    assert path.read_text() == on_disk
    assert files(tmp_path) == {"state.json"}

    monkeypatch.undo()  # the storage is back: the same call now goes through
    assert c.set_toggle("tenant-a", True, Operator("bob"))["cuda_graph"] is True
    assert c.version == before[2] + 1 and len(c.audit) == 2


def test_a_state_directory_that_cannot_exist_changes_nothing(tmp_path):
    """The state path lies under a regular file (refused even to root): an error, nothing changed."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    c = GraphController(str(blocker / "state.json"), INITIAL)
    result = c.set_toggle("tenant-a", False, Operator("alice"))
    assert "error" in result and "not-a-directory" in result["error"]
    assert snapshot(c) == (INITIAL, [], 0)
    assert files(tmp_path) == {"not-a-directory"}


def test_a_failing_json_dump_leaves_no_temp_file(tmp_path, monkeypatch):
    """A failure while the temp file is being written (here: fsync) removes it too."""
    path = tmp_path / "state.json"
    c = GraphController(str(path), INITIAL)

    def broken(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(controller_module.os, "fsync", broken)
    assert "Input/output error" in c.set_toggle("tenant-a", False, Operator("alice"))["error"]
    assert snapshot(c) == (INITIAL, [], 0)
    assert files(tmp_path) == set()


def test_a_set_that_changes_nothing_is_not_audited(tmp_path):
    """Setting the value a tenant already has returns the current state: no audit entry, no new
    version. So a call Ray retries (max_task_retries=-1) after the actor restarted, when the first
    attempt had already been persisted, is not audited twice."""
    path = tmp_path / "state.json"
    c = GraphController(str(path), INITIAL)
    first = c.set_toggle("tenant-a", False, Operator("alice"))
    assert c.set_toggle("tenant-a", False, Operator("alice")) == first
    assert c.set_toggle("tenant-b", False, Operator("bob"))["updated_by"] is None  # off in the config already
    assert c.version == 1 and len(c.audit) == 1

    restarted = GraphController(str(path), INITIAL)  # the retry lands on the restarted actor
    assert restarted.set_toggle("tenant-a", False, Operator("alice")) == first
    assert restarted.version == 1 and len(restarted.audit) == 1
    assert json.loads(path.read_text())["version"] == 1


def test_the_audit_log_is_bounded_in_memory_and_on_disk(tmp_path, monkeypatch):
    """Only the last AUDIT_KEEP entries are kept (here 4, to keep the test fast), in both places."""
    monkeypatch.setattr(controller_module, "AUDIT_KEEP", 4)
    path = tmp_path / "state.json"
    c = GraphController(str(path), {})
    for i in range(9):
        c.set_toggle("tenant-a", i % 2 == 1, Operator("alice"))
    assert len(c.audit) == 4 == len(json.loads(path.read_text())["audit"])
    assert [a["after"] for a in c.audit] == [True, False, True, False]  # the last four changes
    assert c.version == 9


def test_the_state_file_is_replaced_atomically(tmp_path, monkeypatch):
    """The new state reaches the path only through one os.replace of a complete, fsynced temp file
    from the same directory (a rename within one file system is atomic)."""
    path = tmp_path / "state.json"
    c = GraphController(str(path), INITIAL)
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        assert Path(src).parent == tmp_path and json.loads(Path(src).read_text())["toggles"]["tenant-a"] is False
        replaced.append(Path(dst))
        real_replace(src, dst)

    monkeypatch.setattr(controller_module.os, "replace", spy)
    c.set_toggle("tenant-a", False, Operator("alice"))
    assert replaced == [path]


def test_lora_adapters_are_persisted_audited_and_a_failed_write_registers_nothing(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    c = GraphController(str(path), INITIAL)
    added = c.add_lora_adapter("sql", "/adapters/sql", Operator("alice"))
    assert added["name"] == "sql" and added["path"] == "/adapters/sql" and added["added_by"] == "alice"
    assert c.add_lora_adapter("sql", "/adapters/sql", Operator("bob")) == added  # the same again: nothing new
    assert c.add_lora_adapter("sql", "/adapters/sql-v2", Operator("bob"))["path"] == "/adapters/sql-v2"
    restarted = GraphController(str(path), INITIAL)
    assert restarted.get_lora_adapters()["sql"]["path"] == "/adapters/sql-v2"
    assert [(a["action"], a["actor"], a.get("replaced_path")) for a in restarted.audit] == [
        ("add_lora_adapter", "alice", None),
        ("add_lora_adapter", "bob", "/adapters/sql"),
    ]
    assert c.tenant("tenant-a")["updated_by"] is None  # adapter entries name no tenant

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(controller_module.os, "replace", full)
    assert "No space left" in c.add_lora_adapter("chat", "/adapters/chat", Operator("alice"))["error"]
    assert c.remove_lora_adapter("sql", Operator("alice"))["status"] == 409
    assert set(c.get_lora_adapters()) == {"sql"}
    monkeypatch.undo()
    assert c.remove_lora_adapter("sql", Operator("carol")) == {"name": "sql", "removed": True}
    assert c.remove_lora_adapter("sql", Operator("carol"))["status"] == 404
    assert GraphController(str(path), INITIAL).get_lora_adapters() == {}


class FakeActorHandle:
    """A Ray actor handle's shape: handle.before.remote(deadline, name, args, kwargs) gives an awaitable."""

    def __init__(self, answers: dict, hang: frozenset = frozenset(), late: frozenset = frozenset()) -> None:
        self.answers, self.hang, self.late, self.calls, self.deadlines, self.call_ids = answers, hang, late, [], [], []
        self.before = SimpleNamespace(remote=self._answer)

    async def _answer(self, deadline: float, name: str, args: tuple, kwargs: dict, call_id: str):
        self.calls.append((name, args))
        self.deadlines.append(deadline)
        self.call_ids.append(call_id)
        if name in self.hang:
            await asyncio.Event().wait()
        if name in self.late:  # what the real actor raises for a call that came after its deadline
            raise controller_module.CallExpired(f"{name} reached the controller after its caller stopped waiting")
        return self.answers[name]


async def test_the_client_calls_the_controller_method_it_is_given(monkeypatch):
    """Calls name a GraphController method, not a string: the actor gets that method's name and
    arguments; one that does not answer in time is ControllerUnavailable naming it."""
    handle = FakeActorHandle({"tenant": {"tenant": "a"}, "replica_statuses": {}}, hang=frozenset({"audit_log"}))
    monkeypatch.setattr(controller_module, "controller_handle", lambda config: handle)
    client = controller_module.ControllerClient(SimpleNamespace(controller_timeout_s=0.05))
    assert await client.call(GraphController.tenant, "a") == {"tenant": "a"}
    assert await client.call_within(1.0, GraphController.replica_statuses) == {}
    assert handle.calls == [("tenant", ("a",)), ("replica_statuses", ())]
    with pytest.raises(controller_module.ControllerUnavailable, match="audit_log"):
        await client.call(GraphController.audit_log, 10)


async def test_the_client_sends_its_deadline_and_a_late_call_is_unavailable(monkeypatch):
    """Each call carries the moment its caller stops waiting (now + the timeout), and a call the
    controller refused as late is ControllerUnavailable (a 503), as one it never answered."""
    handle = FakeActorHandle({"tenant": {}}, late=frozenset({"set_toggle"}))
    monkeypatch.setattr(controller_module, "controller_handle", lambda config: handle)
    client = controller_module.ControllerClient(SimpleNamespace(controller_timeout_s=3.0))
    sent = time.time()
    await client.call(GraphController.tenant, "a")
    assert sent + 3.0 <= handle.deadlines[-1] <= time.time() + 3.0
    with pytest.raises(controller_module.ControllerUnavailable, match="set_toggle"):
        await client.call(GraphController.set_toggle, "a", False, "alice")


async def test_a_controller_that_dies_again_while_its_call_is_retried_is_unavailable(monkeypatch):
    """The client retries once on a new handle when the actor died; a controller killed again
    before that retry answered raised RayActorError through to the route (a 500, not a 503)."""
    import ray

    class Dead(FakeActorHandle):
        async def _answer(self, deadline: float, name: str, args: tuple, kwargs: dict, call_id: str):
            self.calls.append((name, args))
            self.call_ids.append(call_id)
            raise ray.exceptions.RayActorError()

    handles = [Dead({}), Dead({})]
    used = list(handles)
    monkeypatch.setattr(controller_module, "controller_handle", lambda config: handles.pop(0))
    client = controller_module.ControllerClient(SimpleNamespace(controller_timeout_s=1.0))
    with pytest.raises(controller_module.ControllerUnavailable, match="rollout_action"):
        await client.call_within(1.0, GraphController.rollout_action, "promote", Operator("alice"))
    assert handles == []  # it was retried once, on a new handle
    assert used[0].call_ids == used[1].call_ids and used[0].call_ids[0]  # as one call: it runs once


async def test_a_retried_call_whose_change_was_persisted_is_answered_not_run_again(tmp_path):
    """A write the controller persisted just before it died is retried (by Ray, max_task_retries=-1,
    or by the client on a new handle) with the same call id on the restarted actor: it answers with
    the state the call made. Run again, a pause was a 409 for the pause that took effect, a start
    another rollout, a removal a 404. A new call with the same arguments still runs (and conflicts)."""
    path = tmp_path / "state.json"
    alice, later = Operator("alice"), time.time() + 60
    plan = {"steps": [{"percent": 10, "hold_s": 60}, {"percent": 100}]}
    first = GraphController(str(path), INITIAL)
    started = await first.before(later, "start_rollout", (plan, alice), {}, "call-1")
    paused = await first.before(later, "rollout_action", ("pause", alice), {}, "call-2")
    first.add_lora_adapter("sql", "/adapters/sql", alice)
    removed = await first.before(later, "remove_lora_adapter", ("sql", alice), {}, "call-3")
    toggled = await first.before(later, "set_toggle", ("tenant-a", False, alice), {}, "call-4")
    audited = len(first.audit)

    restarted = GraphController(str(path), INITIAL)  # the retries land on the restarted actor
    assert await restarted.before(later, "start_rollout", (plan, alice), {}, "call-1") == started | {
        "rollout": restarted.current_rollout()
    }
    assert restarted.rollout.id == "rollout-1" and restarted.rollouts_started == 1
    again = await restarted.before(later, "rollout_action", ("pause", alice), {}, "call-2")
    assert again == paused and again["rollout"]["phase"] != started["rollout"]["phase"]
    assert await restarted.before(later, "remove_lora_adapter", ("sql", alice), {}, "call-3") == removed
    assert (await restarted.before(later, "set_toggle", ("tenant-a", False, alice), {}, "call-4")) == toggled
    assert len(restarted.audit) == audited and restarted.version == first.version

    fresh = await restarted.before(later, "rollout_action", ("pause", alice), {}, "call-5")
    assert fresh["status"] == 409  # a second pause asked for is refused as before
    assert await restarted.before(later, "remove_lora_adapter", ("sql", alice), {}, "call-6") == {
        "error": "no adapter 'sql' was registered through the admin API",
        "status": 404,
    }


def test_a_tenants_last_change_is_kept_past_the_audit_log(tmp_path, monkeypatch):
    """Who changed a tenant's toggle, and when, was read from the audit log: after AUDIT_KEEP other
    entries it read null. It is kept per tenant (and survives a restart); a state file of an
    earlier version takes it from its audit log."""
    monkeypatch.setattr(controller_module, "AUDIT_KEEP", 3)
    path = tmp_path / "state.json"
    c = GraphController(str(path), INITIAL)
    changed = c.set_toggle("tenant-a", False, Operator("alice"))
    for i in range(4):
        c.set_toggle("tenant-b", i % 2 == 0, Operator("bob"))
    assert all(a.get("tenant") != "tenant-a" for a in c.audit)  # gone from the log
    assert c.tenant("tenant-a") == changed and changed["updated_by"] == "alice"
    assert GraphController(str(path), INITIAL).tenant("tenant-a") == changed

    state = json.loads(path.read_text())
    del state["tenant_updates"]
    path.write_text(json.dumps(state))
    earlier = GraphController(str(path), INITIAL)
    assert earlier.tenant("tenant-b")["updated_by"] == "bob" and earlier.tenant("tenant-a")["updated_by"] is None


async def test_a_call_that_reaches_the_controller_after_its_deadline_is_not_run(tmp_path):
    """A call held by a stalled controller past the time its caller waited (the caller answered
    503) is refused when it arrives: the toggle and the audit log stay as they were. In time, the
    same call (sync or async method) runs."""
    c = GraphController(str(tmp_path / "state.json"), INITIAL)
    before = snapshot(c)
    with pytest.raises(controller_module.CallExpired, match="set_toggle"):
        await c.before(time.time() - 0.001, "set_toggle", ("tenant-a", False, Operator("alice")), {})
    assert snapshot(c) == before
    done = await c.before(
        time.time() + 5, "set_toggle", ("tenant-a", False), {"operator": Operator("alice", "10.0.0.1")}
    )
    assert done["cuda_graph"] is False and c.toggles["tenant-a"] is False
    version, permissions = await c.before(time.time() + 5, "get_permissions", (), {})
    assert version == c.version and permissions["toggles"]["tenant-a"] is False


def test_a_replica_that_leaves_is_out_of_the_statuses_at_once(tmp_path):
    c = GraphController(str(tmp_path / "state.json"), {})
    c.report("r1", {"state": "READY"})
    c.report("r2", {"state": "READY"})
    c.leave("r1")
    c.leave("never-reported")
    assert set(c.replica_statuses()) == {"r2"}
    c.report("r1", {"state": "READY"})  # a replica that reports again is back
    assert set(c.replica_statuses()) == {"r1", "r2"}


def test_an_adapter_is_refused_while_a_live_replica_refuses_it_and_none_holds_it(tmp_path):
    c = GraphController(str(tmp_path / "state.json"), {})
    wide = {"path": "/adapters/wide", "reason": "r: rank 16 is above max_lora_rank 8"}
    mended = {"path": "/adapters/sql", "reason": "no adapter_config.json"}
    c.report("r1", {"state": "READY", "lora": {"adapters": {}, "refused": {"wide": wide, "sql": mended}}})
    c.report("r2", {"state": "READY", "lora": {"adapters": {"sql": {"slot": 1, "requests": 0}}, "refused": {}}})
    c.report("r3", {"state": "READY"})  # LoRA off, or a status of an earlier version
    assert c.lora_refusals() == {"wide": wide}  # r2 loaded sql since: it serves
    c.leave("r1")
    assert c.lora_refusals() == {}


def test_an_invalid_plan_is_refused_in_our_words_naming_the_field(tmp_path):
    """A rollout plan's 400 began with pydantic's "Value error, " and named no field, unlike the
    admin API's other 400s; each now says what is wrong and, where it is one field, which."""
    c = GraphController(str(tmp_path / "state.json"), {})
    decreasing = c.start_rollout(
        {"steps": [{"percent": 50, "hold_s": 1}, {"percent": 10}]}, Operator("alice", "10.0.0.1")
    )
    assert decreasing["status"] == 400 and not decreasing["field"]
    assert decreasing["error"].startswith("steps: percentages must not decrease")
    typed = c.start_rollout({"steps": [{"percent": "50"}]}, Operator("alice", "10.0.0.1"))
    assert (typed["status"], typed["field"]) == (400, "steps.0.percent")
    assert "Value error" not in decreasing["error"] + typed["error"]
    assert c.audit_log(10) == []


def test_every_operators_change_is_audited_with_the_client_address(tmp_path):
    """Only tenant toggles carried the caller's address; rollouts, their actions, swaps and adapter
    changes had `client: None`. The decision loop's own transitions have none."""
    c = GraphController(str(tmp_path / "state.json"), {})
    c.start_rollout({"steps": [{"percent": 10, "hold_s": 60}, {"percent": 100}]}, Operator("alice", "10.0.0.1"))
    c.rollout_action("abort", Operator("bob", "10.0.0.2"))
    c.add_lora_adapter("sql", "/adapters/sql", Operator("carol", "10.0.0.3"))
    c.remove_lora_adapter("sql", Operator("carol", "10.0.0.3"))
    assert [(e["actor"], e["client"]) for e in c.audit_log(10)] == [
        ("alice", "10.0.0.1"),
        ("alice", "10.0.0.1"),
        ("bob", "10.0.0.2"),
        ("carol", "10.0.0.3"),
        ("carol", "10.0.0.3"),
    ]


def test_a_changed_tenants_config_wins_and_an_operators_change_stays(tmp_path):
    """The state file's toggles overrode the configuration's for good: a redeploy with tenant-a
    turned off kept it on, and tenants dropped from the configuration came back. Now a tenant whose
    configured value changed takes it (audited), one whose configured value stayed keeps an
    operator's change, and a dropped tenant goes unless an operator set it."""
    path = str(tmp_path / "state.json")
    first = GraphController(path, {"a": True, "b": True, "c": True, "gone": True, "kept": True})
    first.set_toggle("b", False, Operator("alice", "10.0.0.1"))  # an operator's change, configured value untouched
    first.set_toggle("kept", False, Operator("alice", "10.0.0.1"))
    second = GraphController(path, {"a": False, "b": True, "c": True, "new": False})
    assert second.toggles == {"a": False, "b": False, "c": True, "new": False, "kept": False}
    changes = [
        (e["tenant"], e["before"], e["after"]) for e in second.audit_log(10) if e["action"] == "configure_cuda_graph"
    ]
    assert changes == [("a", True, False), ("new", True, False)]
    again = GraphController(path, {"a": False, "b": True, "c": True, "new": False})  # nothing changed since
    assert again.toggles == second.toggles and again.version == second.version


def test_a_running_controller_takes_a_changed_tenants_config_from_a_starting_replica(tmp_path):
    """The controller is a detached actor: a redeploy with a new configuration finds it running, so a
    starting replica brings the configuration's tenants when it asks what to load."""
    c = GraphController(str(tmp_path / "state.json"), {"a": True})
    version = c.version
    c.adopt(c.made_for or {}, "replica r1", "r1", {"a": False})
    assert c.toggles == {"a": False} and c.version > version
