"""A replica on a stand-in engine: whatever the engine does meanwhile, its turn in a rolling swap
reports the step it ended in (the controller's swap waits on it), and a request counts the outcome
it ended with, however early its caller lets go of it."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

from app.config import AppConfig
from app.metrics import CarriedCounters, RequestMetrics
from app.replica import LLMReplica
from workers.front.async_engine import EngineDeadError
from workers.modeling.synthetic import build_byte_tokenizer
from workers.protocol import ChoiceChunk, GenerateRequest, StreamEvent
from workers.serving.outputs import EngineStatus, KvCacheStatus
from workers.serving.sampling import SamplingParams


class KilledDuringSwap:
    """An engine whose child is killed while it loads the new model: the swap fails, and the status
    asked right after fails too (the child is being restarted in place, on the old model)."""

    swapping = False
    failure = None
    tokenizer = "the old model's tokenizer"

    async def swap(self, config) -> dict:
        raise EngineDeadError("the engine process exited (exit code -9)")

    async def status(self) -> EngineStatus:
        raise EngineDeadError("the engine process is restarting")


KV = KvCacheStatus(page_size=16, pages=8, pages_free=8, pages_cached=0, max_num_seqs=4, preemptions=0)


def test_a_request_left_at_its_last_chunk_is_counted_ok():
    """The ingress lets go of a request's items once the chunk with a finish reason arrives, so the
    replica's generator is closed at that yield: the outcome must be counted before it (it was
    counted 'cancelled', for 11 of 78 finished requests in a probe)."""
    metrics = RequestMetrics()

    async def first_events(prompt_ids, params, choice_ids, tenant, adapter, resume):
        async def nothing_more():
            return
            yield

        return [(StreamEvent(choice_ids[0], [5, 6], "ok", len(prompt_ids), 2, "length"), nothing_more())]

    replica = SimpleNamespace(
        config=AppConfig.from_args({}),
        draining=False,
        tenant_of={},
        denial_of={},
        tokenizer=build_byte_tokenizer(),
        engine_status=EngineStatus("READY", 256, "rev", "sdpa", {}, 0.0, {}, {}, KV),
        replica_id="r1",
        metrics=metrics,
        _denial=lambda tenant, request_id: None,
        _first_events=first_events,
    )
    request = GenerateRequest("tenant-a", "completion", SamplingParams(), 2, prompt="Hello")

    async def leave_at_the_last_chunk() -> ChoiceChunk:
        items = LLMReplica._generate(replica, request)
        last = await anext(items)
        await items.aclose()
        return last

    assert asyncio.run(leave_at_the_last_chunk()).finish_reason == "length"
    assert metrics.requests == {("tenant-a", "ok"): 1}


def test_a_swap_whose_engine_dies_is_reported_reverted_not_left_loading():
    """The status read after the failed swap raised out of the turn, so the step stayed 'loading'
    and the controller's swap waited 30 minutes (replica_timeout_s), refusing every other swap."""
    reports = []
    replica = SimpleNamespace(
        config=AppConfig.from_args({}),
        engine=KilledDuringSwap(),
        engine_status=EngineStatus("READY", 256, "rev", "sdpa", {}, 0.0, {}, {}, KV),
        tenant_of={},
        draining=False,
        replica_id="r1",
        model_fallback=None,
        controller=SimpleNamespace(notify=lambda method, replica_id, status: reports.append(status)),
        status=lambda: {"swap": dict(replica.swap_progress)},
    )
    for name in ("_swap", "_set_swap_step", "_drain", "_refresh_status"):
        setattr(replica, name, getattr(LLMReplica, name).__get__(replica))
    order = {"id": "swap-1", "target": {"graph_policy": {"mode": "eager"}}, "drain_timeout_s": 1.0}
    asyncio.run(asyncio.wait_for(replica._swap(order), 10))
    steps = [r["swap"]["step"] for r in reports]
    assert steps == ["draining", "loading", "reverted"] and "exit code -9" in reports[-1]["swap"]["detail"]
    assert not replica.draining and replica.engine_status.state == "STARTING"


class PipeClosedDuringSwap:
    """An engine being rebuilt: its old child's pipe is closed."""

    async def check_adapter(self, name: str, path: str) -> dict:
        raise BrokenPipeError(32, "Broken pipe")


def test_an_adapter_check_during_a_swap_is_a_503_saying_so():
    """POST /admin/lora-adapters while the replica rebuilt its engine answered 'engine process has
    stopped: BrokenPipeError', which reads like a crash; the replica says it is swapping."""
    replica = SimpleNamespace(engine=PipeClosedDuringSwap(), draining=True, replica_id="r1")
    answer = asyncio.run(LLMReplica.check_adapter(replica, "sql", "/adapters/sql"))
    assert answer == {"error": "replica r1 is swapping its model; retry", "status": 503, "swapping": True}


def test_the_ingress_sends_an_adapter_check_again_past_a_swapping_replica():
    """A registration whose check Serve sent to a replica in its turn of a swap was a 503 while
    other replicas could check it; it is sent again, as requests are, until swap_queue_timeout_s."""
    import ray

    from app.ingress import Ingress

    swapping = {"error": "replica r1 is swapping its model; retry", "status": 503, "swapping": True}
    checked = {"replica_id": "r2", "name": "sql", "slot": 1, "seconds": 0.1}

    def ingress(answers: list[dict | Exception], queue_s: float) -> SimpleNamespace:
        async def check(name: str, path: str) -> dict:
            sent.append((name, path))
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
            if isinstance(answer, Exception):
                raise answer
            return answer

        sent: list[tuple[str, str]] = []
        handle = SimpleNamespace(check_adapter=SimpleNamespace(remote=check))
        fake = SimpleNamespace(
            config=SimpleNamespace(swap_queue_timeout_s=queue_s, engine_start_timeout_s=5.0),
            replicas=SimpleNamespace(options=lambda multiplexed_model_id: handle),
            sent=sent,
        )
        fake._checked_adapter = Ingress._checked_adapter.__get__(fake)
        return fake

    fake = ingress([swapping, swapping, checked], queue_s=5.0)
    assert asyncio.run(fake._checked_adapter("sql", "/adapters/sql")) == checked
    assert fake.sent == [("sql", "/adapters/sql")] * 3
    fake = ingress([swapping], queue_s=0.0)  # no time to wait: the swapping answer stands
    assert asyncio.run(fake._checked_adapter("sql", "/adapters/sql")) == swapping

    # A replica that died under the check raised RayActorError through the route: a 500.
    died = ray.exceptions.RayActorError()
    fake = ingress([died, checked], queue_s=5.0)
    assert asyncio.run(fake._checked_adapter("sql", "/adapters/sql")) == checked and len(fake.sent) == 2
    fake = ingress([died], queue_s=0.0)
    answer = asyncio.run(fake._checked_adapter("sql", "/adapters/sql"))
    assert answer["status"] == 503 and answer["error"] == "the replica checking the adapter failed; retry"


def reporting_replica(engine, **more) -> SimpleNamespace:
    """What LLMReplica.status reads, on a stand-in engine."""
    return SimpleNamespace(
        replica_id="r1",
        state="READY",
        metrics=RequestMetrics(),
        engine=engine,
        start_s=1.0,
        start_parts={},
        draining=False,
        swap_progress=None,
        config=AppConfig.from_args({}),
        model_fallback=None,
        counters=CarriedCounters(),
        **more,
    )


def test_the_replicas_status_carries_engine_counters_across_an_engine_restart():
    """The replica's status (what the controller renders into /metrics) goes through its
    CarriedCounters: an engine restarted in place starts its busy seconds and preemptions from zero,
    and the replica's series keep counting from what they had."""
    replica = reporting_replica(SimpleNamespace(restarts=0))

    def reported(busy_s: float, preemptions: int) -> dict:
        kv = dataclasses.replace(KV, preemptions=preemptions)
        stats = {"since": 100.0 + replica.engine.restarts, "busy_s": {"decode": busy_s}}
        replica.engine_status = EngineStatus("READY", 256, "rev", "sdpa", {}, 0.0, stats, {}, kv)
        return LLMReplica.status(replica)

    first = reported(5.0, 3)
    assert (first["stats"]["busy_s"]["decode"], first["kv_cache"]["preemptions"]) == (5.0, 3)
    replica.engine.restarts = 1
    after = reported(0.5, 0)
    assert (after["stats"]["busy_s"]["decode"], after["kv_cache"]["preemptions"]) == (5.5, 3)


class CountingEngine:
    """An engine that decodes until its swap starts (the drain lets its streams finish) and whose
    swap starts its counters again (the gate's new stats)."""

    swapping = False
    failure = None
    restarts = 0
    tokenizer = "a tokenizer"

    def __init__(self) -> None:
        self.since, self.steps = 100.0, 10

    async def status(self) -> EngineStatus:
        return EngineStatus(
            "READY", 256, "rev", "sdpa", {}, 0.0, {"since": self.since, "decode_steps": self.steps}, {}, KV
        )

    async def swap(self, config) -> dict:
        self.since, self.steps = 200.0, 0
        return {"path": "in_place"}


def test_a_swap_carries_the_steps_its_drain_let_finish():
    """The counters are read after the drain, before the swap starts them again: the steps the
    drained streams ran since the last report were lost (17-53 decode rows a swap in a probe)."""
    engine = CountingEngine()
    replica = reporting_replica(
        engine, tenant_of={}, controller=SimpleNamespace(notify=lambda method, replica_id, status: None)
    )
    for name in ("_swap", "_set_swap_step", "_drain", "_refresh_status", "status"):
        setattr(replica, name, getattr(LLMReplica, name).__get__(replica))
    asyncio.run(replica._refresh_status())
    assert replica.status()["stats"]["decode_steps"] == 10
    engine.steps = 12  # the drained streams' last steps, after the last report
    order = {"id": "swap-1", "target": {"graph_policy": {"mode": "eager"}}, "drain_timeout_s": 1.0}
    asyncio.run(asyncio.wait_for(replica._swap(order), 10))
    assert replica.swap_progress["step"] == "serving"
    assert replica.status()["stats"]["decode_steps"] == 12


class ScreeningEngine(CountingEngine):
    """A READY engine that records each screening of the served adapters, and the restart it was in."""

    def __init__(self) -> None:
        super().__init__()
        self.screened: list[tuple[int, dict[str, str]]] = []

    async def screen_adapters(self, adapters: dict[str, str]) -> dict[str, str]:
        self.screened.append((self.restarts, adapters))
        return {"late": "r: rank 8 is above max_lora_rank 4"}


def test_the_served_adapters_are_screened_once_per_engine_that_serves():
    """Refusals live in the engine: a replica screens the served adapters (the config's and the
    registered ones, bar the served model's name) once its engine serves, again after the engine
    restarted in place or swapped (each forgets them), and not on every status report."""
    config = AppConfig.from_args(
        {"served_model_name": "base", "lora": {"max_loras": 2, "max_lora_rank": 4}, "lora_modules": {"sql": "/a/sql"}}
    )
    registered = {"late": {"path": "/a/late"}, "base": {"path": "/a/shadowed"}}

    async def call(method, *args):
        assert method.__name__ == "get_lora_adapters"
        return registered

    engine = ScreeningEngine()
    reports: list[dict] = []
    controller = SimpleNamespace(notify=lambda method, replica_id, status: reports.append(status), call=call)
    replica = reporting_replica(engine, controller=controller, configured=config, cohort_rule=None, tenant_of={})
    replica.config, replica.engine_status, replica._screened_restarts, replica._background = config, None, None, []
    for name in ("_report", "_refresh_status", "_screen_adapters", "status", "_swap", "_set_swap_step", "_drain"):
        setattr(replica, name, getattr(LLMReplica, name).__get__(replica))

    async def report_until_screened(times: int, more_reports: int = 0) -> None:
        reporting = asyncio.create_task(replica._report())
        try:
            while len(engine.screened) < times:
                await asyncio.sleep(0.01)
            seen = len(reports)
            while len(reports) < seen + more_reports:
                await asyncio.sleep(0.01)
        finally:
            reporting.cancel()

    served = {"late": "/a/late", "sql": "/a/sql"}
    asyncio.run(asyncio.wait_for(report_until_screened(1, more_reports=2), 10))
    assert engine.screened == [(0, served)]
    engine.restarts = 1  # restarted in place: a new child, its refusals forgotten
    asyncio.run(asyncio.wait_for(report_until_screened(2), 10))
    assert engine.screened == [(0, served), (1, served)]
    order = {"id": "swap-1", "target": {"graph_policy": {"mode": "eager"}}, "drain_timeout_s": 1.0}
    asyncio.run(asyncio.wait_for(replica._swap(order), 10))
    assert replica.swap_progress["step"] == "serving"
    asyncio.run(asyncio.wait_for(report_until_screened(3), 10))
    assert engine.screened[2] == (1, served)
