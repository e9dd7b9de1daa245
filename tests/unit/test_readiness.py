"""The ingress's readiness view: one controller call per refresh however many requests ask, no
request waits for the controller while a replica was READY, a restarted controller's short memory
is bridged, and a failing controller keeps the last view."""

from __future__ import annotations

import asyncio

import pytest

from app.readiness import ReadinessView

pytestmark = pytest.mark.timeout(10)


class Controller:
    """Replica statuses on demand; `gate` holds every answer until a test releases it."""

    def __init__(self, states: dict[str, str]) -> None:
        self.states = states
        self.calls = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.error: Exception | None = None

    async def fetch(self) -> dict[str, dict]:
        self.calls += 1
        await self.gate.wait()
        if self.error is not None:
            raise self.error
        return {r: {"state": s} for r, s in self.states.items()}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_burst_after_expiry_makes_one_call():
    controller = Controller({"r1": "GRAPH_CAPTURED"})
    clock = Clock()
    view = ReadinessView(controller.fetch, max_age_s=1.0, clock=clock)
    controller.gate.clear()
    burst = [asyncio.create_task(view.any_ready()) for _ in range(32)]
    await asyncio.sleep(0)
    controller.states["r1"] = "READY"
    controller.gate.set()
    assert await asyncio.gather(*burst) == [True] * 32
    assert controller.calls == 1
    clock.now += 0.5
    assert await view.any_ready() and controller.calls == 1  # still fresh: no call
    clock.now += 1.0
    controller.gate.clear()
    second = [asyncio.create_task(view.any_ready()) for _ in range(32)]
    assert await asyncio.gather(*second) == [True] * 32  # answered from the view, not waiting
    assert controller.calls == 2  # and one background refresh for all of them
    controller.gate.set()


async def test_requests_do_not_wait_for_the_controller_once_ready():
    controller = Controller({"r1": "READY"})
    clock = Clock()
    view = ReadinessView(controller.fetch, clock=clock)
    assert await view.any_ready()
    clock.now += 2.0
    controller.gate.clear()  # the controller is slow to answer
    assert await asyncio.wait_for(view.any_ready(), 0.5)
    controller.states["r1"] = "FAILED"
    controller.gate.set()
    await asyncio.sleep(0.01)  # the background refresh lands
    assert not await view.any_ready()


async def test_before_any_ready_callers_wait_for_the_answer():
    controller = Controller({"r1": "EAGER_WARMED"})
    clock = Clock()
    view = ReadinessView(controller.fetch, clock=clock)
    assert not await view.any_ready()
    controller.states["r1"] = "READY"
    assert not await view.any_ready()  # within max_age: the cached "not yet"
    clock.now += 1.5
    assert await view.any_ready()


async def test_a_cancelled_caller_does_not_cancel_the_refresh():
    controller = Controller({"r1": "READY"})
    view = ReadinessView(controller.fetch, clock=Clock())
    controller.gate.clear()
    first, second = asyncio.create_task(view.any_ready()), asyncio.create_task(view.any_ready())
    await asyncio.sleep(0)
    first.cancel()
    controller.gate.set()
    assert await second and controller.calls == 1


async def test_replica_missing_after_controller_restart_stays_for_the_grace_period():
    controller = Controller({"r1": "READY"})
    clock = Clock()
    view = ReadinessView(controller.fetch, max_age_s=1.0, grace_s=5.0, clock=clock)
    assert await view.any_ready()
    controller.states = {}  # a restarted controller has heard from nobody yet
    for _ in range(4):
        clock.now += 1.5
        assert await view.any_ready()
        await asyncio.sleep(0.01)
    clock.now += 1.5  # 6 s since the first answer without r1
    await view.any_ready()
    await asyncio.sleep(0.01)
    assert not await view.any_ready()


async def test_grace_starts_when_the_controller_answers_again():
    """A controller down for longer than the grace period, then back with nobody reported yet: the
    replica stays READY in the view for the grace period counted from that first answer."""
    controller = Controller({"r1": "READY"})
    clock = Clock()
    view = ReadinessView(controller.fetch, max_age_s=1.0, grace_s=5.0, clock=clock)
    assert await view.any_ready()
    controller.error = RuntimeError("controller restarting")
    clock.now += 20.0  # four times the grace, unanswered
    assert await view.any_ready()
    await asyncio.sleep(0.01)
    controller.error, controller.states = None, {}
    clock.now += 1.5
    assert await view.any_ready()  # the first answer without r1: answered from the view
    await asyncio.sleep(0.01)
    assert await view.any_ready()  # r1 kept: its grace only started now
    clock.now += 3.0
    await view.any_ready()
    await asyncio.sleep(0.01)
    assert await view.any_ready()  # 3 s into the grace
    controller.states = {"r1": "READY"}  # r1 reports again
    clock.now += 3.0
    await view.any_ready()
    await asyncio.sleep(0.01)
    controller.states = {}
    clock.now += 4.0
    await view.any_ready()
    await asyncio.sleep(0.01)
    assert await view.any_ready()  # listed again in between: a fresh grace


async def test_controller_failure_keeps_the_last_view(caplog):
    controller = Controller({"r1": "READY"})
    clock = Clock()
    view = ReadinessView(controller.fetch, clock=clock)
    assert await view.any_ready()
    controller.error = RuntimeError("controller restarting")
    clock.now += 2.0
    assert await view.any_ready()  # answered from the view; the refresh behind it fails
    await asyncio.sleep(0.01)
    assert controller.calls == 2
    assert await view.any_ready()  # a failed refresh leaves the view stale: the next caller retries
    await asyncio.sleep(0.01)
    assert controller.calls == 3
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1  # once per outage
    controller.error = None
    controller.states["r1"] = "FAILED"
    await view.any_ready()
    await asyncio.sleep(0.01)
    assert controller.calls == 4 and not await view.any_ready()


async def test_the_replicas_not_serving_are_those_known_in_another_state():
    """What the router passes over while another replica serves: known replicas that are neither
    READY nor swapping (an engine restarting reads STARTING, a failed one FAILED)."""
    controller = Controller({"r1": "READY", "r2": "STARTING", "r3": "REBUILDING", "r4": "FAILED"})
    view = ReadinessView(controller.fetch)
    assert view.not_serving() == set()  # nothing known yet
    assert await view.serving() == {"r1", "r3"}
    assert view.not_serving() == {"r2", "r4"}


async def test_a_view_kept_fresh_sees_a_restart_with_no_request_asking():
    """After a quiet spell the router must not read a view from before it: kept fresh, the view
    follows the controller every max_age_s whether requests come or not."""
    controller = Controller({"r1": "READY", "r2": "READY"})
    view = ReadinessView(controller.fetch, max_age_s=0.02)
    assert await view.serving() == {"r1", "r2"}
    view.keep_fresh()
    view.keep_fresh()  # one refresher, however often it is asked for
    controller.states["r2"] = "STARTING"
    deadline = asyncio.get_running_loop().time() + 5
    while view.not_serving() != {"r2"}:
        assert asyncio.get_running_loop().time() < deadline, "the view never saw the restart"
        await asyncio.sleep(0.01)
    view._keeper.cancel()


async def test_a_view_the_controller_never_answered_is_not_known_and_does_not_wait():
    """A new ingress while the controller hangs: its empty view is not `known` (the ingress then
    lets Serve route instead of refusing every request for as long as the controller hangs), and
    after the first failed look callers no longer wait for the controller."""
    controller = Controller({"r1": "READY"})
    controller.error = RuntimeError("the controller did not answer in time")
    view = ReadinessView(controller.fetch, clock=Clock())
    assert not await view.any_ready() and not view.known
    controller.gate.clear()  # the controller now hangs
    assert not await asyncio.wait_for(view.any_ready(), 1.0) and not view.known
    controller.error = None
    controller.gate.set()
    await asyncio.sleep(0.01)  # the background look answers
    assert await view.any_ready() and view.known
