"""What crosses the boundary between a serving replica and the engine behind it.

A replica talks to one `Engine`: a child process for tensor_parallel_size 1 (`LocalEngine`), or
one Ray actor per rank (`ShardGroup`). Both implement this protocol whole, so the replica never
asks which kind it holds. A request's events come back as `StreamEvent`s, coalesced by the rule of
its `Coalescing`; a stream another engine started goes on from a `Resume`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from policies.dispatch import FallbackReason
from workers.serving.detokenizer import DetokState
from workers.serving.engine import EngineConfig, EngineStatus
from workers.serving.sampling import SamplingParams, TokenLogprob


@dataclass
class StreamEvent:
    """What a consumer sees: the new token ids and text of one read, and the counts so far (and
    the new tokens' logprobs, for a request that asked for them)."""

    request_id: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    seed: int | None = None  # the seed its tokens are drawn with (drawn here when the request had none)
    detok: DetokState | None = None  # the detokenizer's state after this event's tokens
    cached_tokens: int = 0  # prompt tokens its prefill found in the prefix cache (usage)


@dataclass(frozen=True)
class Resume:
    """A stream continued from another engine: the tokens its client got there (all of them, in
    order) and that engine's detokenizer state after them. Its seed is in its SamplingParams."""

    output_ids: list[int]
    detok: DetokState


@dataclass(frozen=True)
class Coalescing:
    """How often a stream is read: at most every interval_s, and with items_per_s, no more often
    than keeps all open streams together within that many items per second. Every item costs the
    replica and the ingress the same whatever it carries, so under load items carry more tokens
    instead of growing in number. The first and the last item go at once."""

    interval_s: float = 0.0
    items_per_s: float | None = None

    def wait_s(self, open_streams: int) -> float:
        """The pause after an item, with this many streams open."""
        if self.items_per_s is None:
            return self.interval_s
        return max(self.interval_s, open_streams / self.items_per_s)


@dataclass(frozen=True)
class EngineRequest:
    """One sequence a replica submits (a choice of a request): its prompt and sampling, its id, the
    graph permission it starts with, how its stream is read, its LoRA adapter (name, path), and
    where it goes on from when another engine started it."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    graph_denial: FallbackReason | None = None
    coalescing: Coalescing = Coalescing()
    adapter: tuple[str, str] | None = None
    resume: Resume | None = None


class Engine(Protocol):
    """An engine as its replica sees it: loaded, captured and verified once `start` returns."""

    config: EngineConfig  # what it serves now (a swap changes it)
    tokenizer: object  # the served checkpoint's tokenizer
    restarts: int  # restarts in place so far
    failure: str | None  # why it is down for good; None while it serves or restarts
    swapping: bool  # a swap (or the start-up gate) has it busy: status calls wait

    async def start(self) -> None:
        """Return once every rank is READY."""

    def submit(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        """The request's events, read as its `coalescing` says."""

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
