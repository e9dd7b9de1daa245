"""The engine behind a replica: a child process for tensor_parallel_size 1, or one Ray actor per GPU.

Shard actors are created inside the replica's own placement group (bundle i + 1 for rank i; bundle 0
holds the replica), each told its rank explicitly, and meet at a TCP rendezvous the replica picks.
Rank 0 runs the engine; requests stream from it through a Ray generator. A dead or stuck shard
makes `check()` fail, so Serve's health check replaces the whole replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import socket
import time
from collections.abc import AsyncIterator

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from policies.dispatch import FallbackReason
from policies.restarts import RestartBudget
from workers.front.async_engine import EngineDeadError
from workers.front.engine_process import EngineChild, EngineProcess
from workers.modeling.checkpoint_dir import CheckpointError, load_tokenizer
from workers.modeling.default_model import model_dir
from workers.protocol import (
    CheckAdapter,
    EngineRequest,
    EngineStatus,
    Gate,
    ScreenAdapters,
    StreamEvent,
    SwapInPlace,
)
from workers.serving.engine_config import EngineConfig

log = logging.getLogger(__name__)
COLOURS = re.compile(r"\x1b\[[0-9;]*m")
RAISED = re.compile(r"[A-Za-z_][\w.]*(Error|Exception): ")


def one_line(error: BaseException) -> str:
    """A Ray actor error in one line, for status fields and clients: the last exception its text
    names (a rank's start failed: the ValueError its __init__ raised), else its first line. Its
    traceback, colour codes, actor id, pid and address stay in the log."""
    lines = [line.strip() for line in COLOURS.sub("", str(error)).splitlines() if line.strip()]
    raised = [line for line in lines if RAISED.match(line)]
    return raised[-1] if raised else lines[0] if lines else type(error).__name__


def rank0_gone(error: ray.exceptions.RayActorError) -> EngineDeadError:
    """What a call to a dead rank 0 raises: one line for the caller, Ray's whole text in the log."""
    log.error("tensor-parallel rank 0 is gone: %s", error)
    return EngineDeadError(f"tensor-parallel rank 0 is gone: {one_line(error)}")


PING_TIMEOUT_S = 5.0


class SwapFailed(RuntimeError):
    """A swap did not pass its gate or could not start; the old model serves again."""


def _in_place(old: EngineConfig, new: EngineConfig) -> bool:
    """Whether `new` only names another checkpoint of the same shapes (its weights load in place).
    The default model (`model` unset) and a .gguf file are compared by their checkpoint directory
    (converted here at most once: the cache keeps it), so it runs in a thread."""
    same_settings = (
        dataclasses.replace(
            new, model=old.model, model_revision=old.model_revision, gate_prompts_file=old.gate_prompts_file
        )
        == old
    )
    if not same_settings:
        return False
    from workers.serving.model_gate import same_shapes  # imports torch: a replica does only when it swaps

    try:
        serving = model_dir(old.model)
    except CheckpointError:  # the serving model's file is gone or changed: the new one loads in a new engine
        return False
    return same_shapes(serving, model_dir(new.model))


class LocalEngine:
    """tensor_parallel_size 1: no actors; the step loop runs in a child process of the replica
    (`workers/front/engine_process.py` says why not in a thread).

    A child that dies, or does not answer within timeout_s (then it is killed), is started again in
    place while the restart budget allows; requests wait for it in `wait_ready`. Once the budget is
    spent the engine is down for good and `check()` fails, so Serve replaces the replica."""

    def __init__(
        self,
        config: EngineConfig,
        budget: RestartBudget,
        timeout_s: float,
        start_timeout_s: float,
        child: EngineChild | None = None,
    ) -> None:
        """`child`: an engine process started ahead of this (one started with another config is
        discarded); the tokenizer is read while the child loads the model."""
        self.config = config
        self.budget = budget
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        if child is not None and child.config != config:
            child.discard()
            child = None
        child = child or EngineChild(config)
        try:
            self.tokenizer = load_tokenizer(model_dir(config.model))
        except BaseException:
            child.discard()
            raise
        self.restarts = 0
        self.failure: str | None = None  # why the engine is down for good
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restarting: asyncio.Task | None = None
        self.swapping = False  # a swap replaces the child on purpose: no restart meanwhile
        self.runner = self._spawn(child)

    def _spawn(self, child: EngineChild | None = None) -> EngineProcess:
        return EngineProcess(self.config, self.tokenizer, self._exited, self.start_timeout_s, child)

    async def swap(self, config: EngineConfig) -> dict:
        """Serve `config` (a new checkpoint or graph policy) instead, gated (`workers/serving/model_gate.py`);
        the engine must be drained. A checkpoint of the same shapes with nothing else changed is
        loaded into the running child's parameters (its graphs stay); anything else gets a new
        child (the old one exits first, freeing its model, KV pool and graphs). If the gate or the
        start fails, the old model serves again (in place: its weights were kept; otherwise its
        child is started again) and SwapFailed says why. Returns the gate's report and the path."""
        old, start = self.config, time.monotonic()
        self.swapping = True
        try:
            if await asyncio.to_thread(_in_place, old, config):
                try:
                    report = await self.runner.ask(SwapInPlace(config))
                except Exception as e:
                    raise SwapFailed(f"{e}") from e
                self.tokenizer = self.runner.tokenizer = load_tokenizer(model_dir(config.model))
                self.config = config
                return {**report, "path": "in_place", "total_s": time.monotonic() - start}
            await asyncio.to_thread(self.runner.shutdown)
            try:
                self.config, self.tokenizer = config, load_tokenizer(model_dir(config.model))
                self.runner = await asyncio.to_thread(self._spawn)
                report = await self.runner.ask(Gate())
            except Exception as e:
                log.error("the new model did not pass (%s); starting the old one again", e)
                if self.runner.alive:
                    await asyncio.to_thread(self.runner.shutdown)
                self.config, self.tokenizer = old, load_tokenizer(model_dir(old.model))
                self.runner = await asyncio.to_thread(self._spawn)
                raise SwapFailed(f"{e}") from e
            return {**report, "path": "rebuild", "total_s": time.monotonic() - start}
        finally:
            self.swapping = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def gate(self) -> dict:
        """Gate the model the child serves (a persisted swap target at start-up)."""
        self.swapping = True
        try:
            return await self.runner.ask(Gate(), self.start_timeout_s)
        finally:
            self.swapping = False

    async def close(self) -> None:
        await asyncio.to_thread(self.runner.shutdown)  # a child told to stop is not restarted

    @property
    def restarting(self) -> bool:
        return self._restarting is not None and not self._restarting.done()

    def submit(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        return self.runner.submit_request(request)

    async def check_adapter(self, name: str, path: str) -> dict:
        """Load and verify an adapter in the engine (InvalidRequest says why it cannot serve)."""
        return await self.runner.ask(CheckAdapter(name, path), self.start_timeout_s)

    async def screen_adapters(self, adapters: dict[str, str]) -> dict[str, str]:
        return await self.runner.ask(ScreenAdapters(adapters), self.start_timeout_s)

    def set_graph_denial(self, request_id: str, reason: FallbackReason | None) -> None:
        self.runner.set_graph_denial(request_id, reason)

    def cancel(self, request_id: str) -> None:
        self.runner.cancel(request_id)

    async def status(self) -> EngineStatus:
        """The child's status within timeout_s; a child that does not answer in time is killed (and
        restarted like a dead one), and a dead one is restarted; both raise EngineDeadError."""
        try:
            return await self.runner.status(self.timeout_s)
        except TimeoutError:
            log.error("engine process (pid %d) did not answer within %g s; killing it", self.runner.pid, self.timeout_s)
            self.runner.kill()
            raise EngineDeadError(f"the engine process did not answer within {self.timeout_s:g} s") from None
        except EngineDeadError:
            self._restart_soon(self.runner.error)
            raise

    async def check(self) -> None:
        """Passes while the engine answers or is being restarted or swapped; fails when it is down for
        good or did not answer in time."""
        if self.failure is None and not self.restarting and not self.swapping:
            try:
                await self.status()
            except EngineDeadError:
                if not self.restarting:  # a wedged child, killed just now, fails this check
                    raise
        if self.failure is not None:
            raise RuntimeError(self.failure)

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait (at most timeout_s) for a restart under way; whether a live engine is there now."""
        if not self.runner.alive:
            self._restart_soon(self.runner.error)
        if self.restarting:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._restarting), timeout_s)
        return self.runner.alive

    def _exited(self, error: BaseException) -> None:
        """From the reader thread of a child that stopped unasked: restart it on the event loop."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the replica is going away
                self._loop.call_soon_threadsafe(self._restart_soon, error)

    def _restart_soon(self, error: BaseException | None) -> None:
        if self.restarting or self.swapping or self.failure is not None or self.runner.alive:
            return
        if self._take_restart(error):
            self._restarting = asyncio.ensure_future(self._restart(error))

    def _take_restart(self, error: BaseException | None) -> bool:
        """Charge one restart to the budget (`restarts` counts each, a start that fails included,
        so a replica given up on shows every restart it was allowed)."""
        if self.budget.take(time.monotonic()):
            self.restarts += 1
            return True
        self.failure = (
            f"the engine process failed {self.budget.max_restarts + 1} times within "
            f"{self.budget.window_s:g} s; last: {error!r}"
        )
        log.error("giving up on the engine: %s", self.failure)
        return False

    async def _restart(self, error: BaseException | None) -> None:
        while True:
            log.warning("restarting the engine process in place after: %r", error)
            start = time.monotonic()
            try:
                self.runner = await asyncio.to_thread(self._spawn)
            except Exception as e:
                log.error("the engine process did not start again: %r", e)
                error = e
                if not self._take_restart(error):
                    return
                continue
            log.warning("engine process restarted (pid %d) in %.1f s", self.runner.pid, time.monotonic() - start)
            return


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ShardGroup:
    """tensor_parallel_size > 1: ShardWorker actors, rank 0 the engine. Shards are not restarted in
    place: a dead rank fails the health check, and Serve replaces the whole replica."""

    def __init__(self, config: EngineConfig, world_size: int, num_gpus: float, num_cpus: float, timeout_s: float):
        self.world_size = world_size
        self.options = {"num_gpus": num_gpus, "num_cpus": num_cpus, "max_concurrency": 1000}
        self.timeout_s = timeout_s
        self.restarts = 0
        self.failure: str | None = None
        self.swapping = False
        self._spawn(config)

    def _spawn(self, config: EngineConfig) -> None:
        """One actor per rank in the replica's placement group (bundle rank + 1), meeting at a new
        rendezvous; they load and capture while `start` waits."""
        self.config = config
        self.tokenizer = load_tokenizer(model_dir(config.model))
        init_method = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
        group = get_current_placement_group()
        from workers.front.shard_worker import ShardWorker  # the engine's imports, torch among them

        actor = ray.remote(ShardWorker)
        self.shards = []
        for rank in range(self.world_size):
            options = dict(self.options)
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank + 1
                )
            self.shards.append(
                actor.options(**options).remote(rank, self.world_size, init_method, config, self.timeout_s)
            )
        self.rank0 = self.shards[0]

    async def start(self) -> None:
        """Wait until every rank has loaded and captured (the replica is not READY before)."""
        try:
            await asyncio.gather(*(s.alive.remote() for s in self.shards))
        except ray.exceptions.RayActorError as e:
            log.error("a tensor-parallel rank did not start: %s", e)
            raise EngineDeadError(f"a tensor-parallel rank did not start: {one_line(e)}") from None

    async def close(self) -> None:
        """Stop the step loop on rank 0 (which stops the followers), then end every rank's actor."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.rank0.shutdown.remote(), PING_TIMEOUT_S)
        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        with contextlib.suppress(Exception):  # until each actor's process is gone and its bundle free
            await asyncio.wait_for(
                asyncio.gather(*(s.alive.remote() for s in self.shards), return_exceptions=True), PING_TIMEOUT_S
            )

    async def swap(self, config: EngineConfig) -> dict:
        """Serve `config` instead, gated on every rank (see LocalEngine.swap): a checkpoint of the
        same shapes with nothing else changed is loaded in place by every rank, and all ranks vote
        before it is kept; anything else ends every rank and starts them all on the new config (then
        the old one again if the new one fails)."""
        old, start = self.config, time.monotonic()
        self.swapping = True
        try:
            if await asyncio.to_thread(_in_place, old, config):
                try:
                    report = await self.rank0.swap_in_place.remote(config)
                except ray.exceptions.RayTaskError as e:
                    raise SwapFailed(f"{e.cause}") from None
                self.config, self.tokenizer = config, load_tokenizer(model_dir(config.model))
                return {**report, "path": "in_place", "total_s": time.monotonic() - start}
            await self.close()
            try:
                self._spawn(config)
                await self.start()
                report = await self._gate()
            except Exception as e:
                log.error("the new model did not pass on the tensor-parallel ranks (%s); starting the old one", e)
                await self.close()
                self._spawn(old)
                await self.start()
                raise SwapFailed(f"{e}") from e
            return {**report, "path": "rebuild", "total_s": time.monotonic() - start}
        finally:
            self.swapping = False

    async def gate(self) -> dict:
        self.swapping = True
        try:
            return await self._gate()
        finally:
            self.swapping = False

    async def _gate(self) -> dict:
        try:
            return await self.rank0.gate.remote()
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None

    async def wait_ready(self, timeout_s: float) -> bool:
        try:
            return not await self._dead_ranks()
        except Exception:  # a rank that cannot answer is not ready
            return False

    async def submit(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        refs = self.rank0.generate.options(num_returns="streaming").remote(request)
        try:
            async for ref in refs:
                try:
                    yield await ref
                except ray.exceptions.RayTaskError as e:
                    raise e.cause from None
                except ray.exceptions.RayActorError as e:
                    raise rank0_gone(e) from None
        finally:
            ray.cancel(refs)

    def set_graph_denial(self, request_id: str, reason: FallbackReason | None) -> None:
        self.rank0.set_graph_denial.remote(request_id, reason)

    def cancel(self, request_id: str) -> None:
        self.rank0.cancel.remote(request_id)

    async def check_adapter(self, name: str, path: str) -> dict:
        try:
            return await self.rank0.check_adapter.remote(name, path)
        except ray.exceptions.RayTaskError as e:
            raise e.cause from None
        except ray.exceptions.RayActorError as e:
            raise rank0_gone(e) from None

    async def screen_adapters(self, adapters: dict[str, str]) -> dict[str, str]:
        try:
            return await self.rank0.screen_adapters.remote(adapters)
        except ray.exceptions.RayActorError as e:
            raise rank0_gone(e) from None

    async def status(self) -> EngineStatus:
        status, shards = await asyncio.wait_for(
            asyncio.gather(self.rank0.status.remote(), asyncio.gather(*(s.shard_status.remote() for s in self.shards))),
            PING_TIMEOUT_S,
        )
        return dataclasses.replace(status, shards=shards)

    async def _dead_ranks(self) -> list[int]:
        alive = await asyncio.wait_for(asyncio.gather(*(s.alive.remote() for s in self.shards)), PING_TIMEOUT_S)
        return [rank for rank, ok in enumerate(alive) if not ok]

    async def check(self) -> None:
        if self.swapping:
            return
        dead = await self._dead_ranks()
        if dead:
            raise RuntimeError(f"tensor-parallel ranks {dead} stopped")
