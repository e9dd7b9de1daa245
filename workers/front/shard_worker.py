"""One tensor-parallel rank of a replica: its share of the weights, its KV cache and its graphs.

Rank 0 runs the whole engine (scheduler, sampling, the asyncio streaming front) and drives the other
ranks through the step channel; ranks > 0 follow in a thread. The serving layer wraps this class in
a Ray actor per GPU; nothing here knows about Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator

import torch

from policies.dispatch import FallbackReason
from workers.front.async_engine import AsyncEngine
from workers.graphs.graph_runner import StepRunners
from workers.modeling.model import LlamaModel
from workers.protocol import EngineRequest, EngineStatus, StreamEvent
from workers.serving.engine import LLMEngine, load_for_engine, make_runners, prepare_model, resolve_device
from workers.serving.engine_config import EngineConfig
from workers.serving.model_gate import run_gate, swap_weights_in_place
from workers.tensor_parallel.tp import Follower, StepChannel, init_tp_group

log = logging.getLogger(__name__)


def prepare_follower(model: LlamaModel, config: EngineConfig) -> StepRunners:
    """What a rank > 0 does before following rank 0: its cache (and LoRA slots), then the same
    warm-up, capture, verification and agreement as rank 0's engine, so both meet the same
    collectives in order."""
    runners = make_runners(model, prepare_model(model, config), config)
    runners.prepare()
    return runners


class ShardWorker:
    def __init__(
        self, rank: int, world_size: int, init_method: str, config: EngineConfig, timeout_s: float = 30.0
    ) -> None:
        device = resolve_device(config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)  # Ray gives each shard actor its own GPU as device 0
        self.rank = rank
        self.tp = init_tp_group(rank, world_size, init_method, device, timeout_s)
        t0 = time.perf_counter()
        model, self.tokenizer, eos, revision = load_for_engine(config, device, self.tp)
        load_s = time.perf_counter() - t0
        self.channel = StepChannel(self.tp, device)
        self.error: BaseException | None = None
        if rank == 0:
            engine = LLMEngine(
                model, config, eos, revision, channel=self.channel, tokenizer=self.tokenizer, load_s=load_s
            )
            self.engine = AsyncEngine(engine, self.tokenizer, heartbeat_s=timeout_s / 4).start()
            self.runners = engine.runners
        else:
            self.runners = prepare_follower(model, config)
            self.follower = Follower(self.channel, self.runners)
            self._thread = threading.Thread(target=self._follow, daemon=True)
            self._thread.start()
        self.captured_at = time.time()

    def shard_status(self) -> dict:
        """This rank's own capture: every rank captures (and replays) its own graphs, each with its
        all-reduces inside, so operators see each rank's buckets, not only rank 0's."""
        buckets = {k: v for runner in self.runners.all for k, v in runner.report().items()}
        return {"rank": self.rank, "captured_at": self.captured_at, "buckets": buckets}

    def _follow(self) -> None:
        try:
            self.follower.follow()
        except BaseException as e:  # a timed-out or broken collective ends this rank
            log.exception("tensor-parallel rank %d stopped following rank 0", self.rank)
            self.error = e

    def alive(self) -> bool:
        if self.rank == 0:
            return self.engine.alive
        return self._thread.is_alive() and self.error is None

    # -- rank 0 only -------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        async for event in self.engine.submit_request(request):
            yield event

    async def check_adapter(self, name: str, path: str) -> dict:
        return await self.engine.call(lambda engine: engine.check_adapter(name, path))

    async def screen_adapters(self, adapters: dict[str, str]) -> dict[str, str]:
        return await self.engine.call(lambda engine: engine.screen_adapters(adapters))

    async def swap_in_place(self, config: EngineConfig) -> dict:
        """Every rank loads `config.model` (same shapes) in place and votes after the gate; the old
        weights serve again on every rank when one fails (`swap_weights_in_place`)."""
        tokenizer, report = await self.engine.call(lambda engine: swap_weights_in_place(engine, config))
        self.tokenizer = self.engine.tokenizer = tokenizer
        return report

    async def gate(self) -> dict:
        """The model gate on every rank (`run_gate`), between two steps."""
        return await self.engine.call(lambda engine: run_gate(engine, self.tokenizer, engine.config.gate_prompts_file))

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def shutdown(self) -> None:
        """Stop the step loop; the follower ranks are told to stop with it."""
        self.engine.shutdown()

    def set_graph_denial(self, request_id: str, reason: FallbackReason | None) -> None:
        self.engine.set_graph_denial(request_id, reason)

    def status(self) -> EngineStatus:
        return self.engine.engine.status()
