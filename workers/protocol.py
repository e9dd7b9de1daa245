"""What crosses the boundary between a serving replica and the engine behind it.

A replica talks to one `Engine`: a child process for tensor_parallel_size 1 (`LocalEngine`), or
one Ray actor per rank (`ShardGroup`). Both implement this protocol whole, so the replica never
asks which kind it holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from policies.dispatch import FallbackReason
from workers.serving.async_engine import Resume, StreamEvent
from workers.serving.engine import EngineConfig, EngineStatus
from workers.serving.sampling import SamplingParams


class Engine(Protocol):
    """An engine as its replica sees it: loaded, captured and verified once `start` returns."""

    config: EngineConfig  # what it serves now (a swap changes it)
    tokenizer: object  # the served checkpoint's tokenizer
    restarts: int  # restarts in place so far
    failure: str | None  # why it is down for good; None while it serves or restarts
    swapping: bool  # a swap (or the start-up gate) has it busy: status calls wait

    async def start(self) -> None:
        """Return once every rank is READY."""

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        graph_denial: FallbackReason | None,
        interval_s: float,
        adapter: tuple[str, str] | None = None,
        resume: Resume | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """The request's events, coalesced at most every interval_s."""

    def set_graph_denial(self, request_id: str, reason: FallbackReason | None) -> None:
        """A running request's graph permission, from its next step on."""

    def cancel(self, request_id: str) -> None:
        """End a running request (finish reason `abort`)."""

    async def status(self) -> EngineStatus:
        """The engine's status; raises EngineDeadError when it cannot answer."""

    async def check(self) -> None:
        """The health check: raises when the engine is down for good or stuck."""

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait for a restart under way; whether a live engine is there now."""

    async def check_adapter(self, name: str, path: str) -> dict:
        """Load and verify a LoRA adapter on every rank; InvalidRequest says why it cannot serve."""

    async def swap(self, config: EngineConfig) -> dict:
        """Serve `config` instead, gated on every rank; SwapFailed when the old model serves again."""

    async def gate(self) -> dict:
        """Gate the model it serves (`workers/serving/model_gate.py`); raises why it failed."""

    async def close(self) -> None:
        """Stop it and free what it holds (processes, actors, device memory)."""
