"""A replica's turn in a rolling swap, on a stand-in engine: whatever the engine does meanwhile, the
replica reports the step its turn ended in, which the controller's swap waits on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from app.config import AppConfig
from app.replica import LLMReplica
from workers.front.async_engine import EngineDeadError
from workers.serving.outputs import EngineStatus, KvCacheStatus


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


def test_a_swap_whose_engine_dies_is_reported_reverted_not_left_loading():
    """The status read after the failed swap raised out of the turn, so the step stayed 'loading'
    and the controller's swap waited 30 minutes (replica_timeout_s), refusing every other swap."""
    reports = []
    kv = KvCacheStatus(page_size=16, pages=8, pages_free=8, pages_cached=0, max_num_seqs=4, preemptions=0)
    replica = SimpleNamespace(
        config=AppConfig.from_args({}),
        engine=KilledDuringSwap(),
        engine_status=EngineStatus("READY", 256, "rev", "sdpa", {}, 0.0, {}, {}, kv),
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
