"""The engine behind a replica: a child process for tensor_parallel_size 1, or one Ray actor per GPU.

Shard actors are created inside the replica's own placement group (bundle i + 1 for rank i; bundle 0
holds the replica), each told its rank explicitly, and meet at a TCP rendezvous the replica picks.
Rank 0 runs the engine; requests stream from it through a Ray generator. A dead or stuck shard
makes `check()` fail, so Serve's health check replaces the whole replica.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from policies.dispatch import FallbackReason
from workers.async_engine import StreamEvent
from workers.checkpoint import load_tokenizer
from workers.default_model import default_model_dir
from workers.engine import EngineConfig
from workers.engine_process import EngineProcess
from workers.sampling import SamplingParams
from workers.shard import ShardWorker

PING_TIMEOUT_S = 5.0


class LocalEngine:
    """tensor_parallel_size 1: no actors; the step loop runs in a child process of the replica
    (`workers/engine_process.py` says why not in a thread)."""

    def __init__(self, config: EngineConfig) -> None:
        self.tokenizer = load_tokenizer(config.model or default_model_dir())
        self.runner = EngineProcess(config, self.tokenizer)

    async def start(self) -> None:
        return None

    def submit(self, prompt_ids, params, request_id, graph_denial, interval_s) -> AsyncIterator[StreamEvent]:
        return self.runner.submit(prompt_ids, params, request_id, graph_denial, interval_s)

    def set_graph_denial(self, request_id: str, reason: FallbackReason | None) -> None:
        self.runner.set_graph_denial(request_id, reason)

    async def status(self) -> dict:
        return await self.runner.status()

    async def check(self) -> None:
        if not self.runner.alive:
            raise RuntimeError(f"engine loop stopped: {self.runner.error!r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ShardGroup:
    """tensor_parallel_size > 1: ShardWorker actors, rank 0 the engine."""

    def __init__(self, config: EngineConfig, world_size: int, num_gpus: float, num_cpus: float, timeout_s: float):
        self.tokenizer = load_tokenizer(config.model or default_model_dir())
        init_method = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
        group = get_current_placement_group()
        actor = ray.remote(ShardWorker)
        self.shards = []
        for rank in range(world_size):
            strategy = (
                PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank + 1)
                if group is not None
                else None
            )
            options = {"num_gpus": num_gpus, "num_cpus": num_cpus, "max_concurrency": 1000}
            if strategy is not None:
                options["scheduling_strategy"] = strategy
            self.shards.append(actor.options(**options).remote(rank, world_size, init_method, config, timeout_s))
        self.rank0 = self.shards[0]

    async def start(self) -> None:
        """Wait until every rank has loaded and captured (the replica is not READY before)."""
        await asyncio.gather(*(s.alive.remote() for s in self.shards))

    async def submit(
        self, prompt_ids, params: SamplingParams, request_id, graph_denial, interval_s
    ) -> AsyncIterator[StreamEvent]:
        refs = self.rank0.generate.options(num_returns="streaming").remote(
            prompt_ids, params, request_id, graph_denial, interval_s
        )
        try:
            async for ref in refs:
                try:
                    yield await ref
                except ray.exceptions.RayTaskError as e:
                    raise e.cause from None
        finally:
            ray.cancel(refs)

    def set_graph_denial(self, request_id: str, reason: FallbackReason | None) -> None:
        self.rank0.set_graph_denial.remote(request_id, reason)

    async def status(self) -> dict:
        status, shards = await asyncio.gather(
            self.rank0.status.remote(), asyncio.gather(*(s.shard_status.remote() for s in self.shards))
        )
        return {**status, "shards": shards}

    async def check(self) -> None:
        alive = await asyncio.wait_for(asyncio.gather(*(s.alive.remote() for s in self.shards)), PING_TIMEOUT_S)
        if not all(alive):
            dead = [rank for rank, ok in enumerate(alive) if not ok]
            raise RuntimeError(f"tensor-parallel ranks {dead} stopped")
