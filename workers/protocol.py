"""What crosses a process boundary on a request's way from the HTTP route to the engine and back.

The ingress sends a replica one `GenerateRequest` and gets `ChoiceChunk` items back, ended early by
a `Failure` when the request cannot go on there. Both travel through Ray as msgpack bytes
(`encode`, `decode_request`, `decode_item`): Ray serializes bytes in ~0.3 us, a dict of the same
fields in ~7-13 us and a pickled class in more (`bench/results/message_codec.md`), and the types
are checked when decoded.

A replica talks to one `Engine`: a child process for tensor_parallel_size 1 (`LocalEngine`), or
one Ray actor per rank (`ShardGroup`). Both implement this protocol whole, so the replica never
asks which kind it holds. A request's events come back as `StreamEvent`s, coalesced by the rule of
its `Coalescing`; a stream another engine started goes on from a `Resume`.

Below the engine's front, the step loop (a thread, or the engine child process) takes one
`Command` at a time between steps and answers with one `StepOutputs` per step for all its
requests; the child process also answers `Question`s and says `Ready` or `Failed` (`ChildMessage`).
A `StepOutputs` crosses from the child as msgpack rows (`encode_step`, `decode_step`), the rest pickled.

Nothing this module imports imports torch: the ingress, the controller and the replica import it,
and only the engine process needs torch (`tests/unit/test_light_imports.py`).
"""

from __future__ import annotations

import concurrent.futures
import pickle
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from policies.dispatch import FallbackReason
from workers.serving.detokenizer import DetokState
from workers.serving.engine_config import EngineConfig
from workers.serving.outputs import EngineStatus, TokenEvent
from workers.serving.sampling import SamplingParams, TokenLogprob
from workers.serving.scheduler import RequestLimits, Sequence

if TYPE_CHECKING:
    from workers.serving.engine import LLMEngine


class Continuation(msgspec.Struct, frozen=True, array_like=True):
    """Where a failed-over request goes on from: the tokens its client got, the seed they were drawn
    with, and the detokenizer's state after them (`app/failover.py`)."""

    output_ids: list[int]
    seed: int | None
    detok: DetokState


class GenerateRequest(msgspec.Struct, frozen=True, array_like=True):
    """A validated OpenAI request, as the ingress sends it to a replica. The replica sets
    `sampling.max_tokens` from `max_tokens` (None: the endpoint's default), fitted to the room the
    prompt leaves; a 400 about it names `max_tokens_field`, the field the client set. A
    failed-over attempt carries `resume` and the replicas to `avoid`. Every attempt names the
    replicas the ingress last saw `not_serving` (an engine restarting): Serve routes to one of
    them only when no other is left."""

    tenant: str
    kind: Literal["chat", "completion"]
    sampling: SamplingParams
    max_tokens: int | None = None
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    n: int = 1
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    adapter: tuple[str, str] | None = None
    resume: Continuation | None = None
    avoid: tuple[str, ...] = ()
    not_serving: tuple[str, ...] = ()


class LogprobItem(msgspec.Struct, frozen=True, array_like=True):
    """One token's logprob with its alternatives', each token as the bytes it stands for (a piece
    of a character split across tokens included: `workers/modeling/token_bytes.py`); its text is
    those bytes read as UTF-8."""

    token: bytes
    logprob: float
    top: list[tuple[bytes, float]]


class ChoiceChunk(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """New text of one choice, with the counts so far (the choice's own) and what another replica
    needs to continue it (token ids, seed, detokenizer state, this replica's id)."""

    index: int
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int  # of the prompt, found in the prefix cache (usage's cached_tokens)
    completion_tokens: int
    token_ids: list[int]
    seed: int | None
    detok: DetokState
    replica_id: str
    logprobs: list[LogprobItem] | None = None


class Failure(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Why a request ends here: its HTTP status (and the field at fault), whether it may go on on
    another replica (`retry`: the replica or its engine failed), and whether it was turned away by a
    swapping replica."""

    error: str
    status: int
    param: str | None = None  # the request field at fault, for OpenAI's error JSON
    retry: bool = False
    replica_id: str | None = None
    swapping: bool = False


Item = ChoiceChunk | Failure
_ENCODER = msgspec.msgpack.Encoder()
_REQUESTS = msgspec.msgpack.Decoder(GenerateRequest)
_ITEMS = msgspec.msgpack.Decoder(Item)


def encode(message: GenerateRequest | Item) -> bytes:
    return _ENCODER.encode(message)


def decode_request(data: bytes) -> GenerateRequest:
    return _REQUESTS.decode(data)


def decode_item(data: bytes) -> Item:
    return _ITEMS.decode(data)


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

    async def screen_adapters(self, adapters: dict[str, str]) -> dict[str, str]:
        """Read adapters' configs (name -> path) against the slots, remembering those refused
        (its status lists them); name -> why, of those."""

    async def swap(self, config: EngineConfig) -> dict:
        """Serve `config` instead, gated on every rank; SwapFailed when the old model serves again."""

    async def gate(self) -> dict:
        """Gate the model it serves (`workers/serving/model_gate.py`); raises why it failed."""

    async def close(self) -> None:
        """Stop it and free what it holds (processes, actors, device memory)."""


# -- the step loop's commands, and what the engine child process sends back -----------------------


@dataclass(frozen=True)
class Add:
    """Admit a sequence (validated by the front)."""

    seq: Sequence


@dataclass(frozen=True)
class Abort:
    """End a request; its last event has this finish reason."""

    request_id: str
    reason: str = "abort"


@dataclass(frozen=True)
class Deny:
    """A running request's graph permission from its next step on."""

    request_id: str
    reason: FallbackReason | None


@dataclass(frozen=True)
class Call:
    """fn(engine) between two steps, its result or error into `done`. In-process only: a function
    and a future do not cross to the engine child."""

    fn: Callable[[LLMEngine], object]
    done: concurrent.futures.Future


@dataclass(frozen=True)
class Stop:
    """End the step loop."""


Command = Add | Abort | Deny | Call | Stop


@dataclass(frozen=True)
class Status:
    """The engine's `EngineStatus`."""


@dataclass(frozen=True)
class SwapInPlace:
    """Load a checkpoint of the same shapes in place and gate it; the old weights serve again when it fails."""

    config: EngineConfig


@dataclass(frozen=True)
class Gate:
    """Gate the model the engine has (`workers/serving/model_gate.py`)."""


@dataclass(frozen=True)
class CheckAdapter:
    """Load and verify a LoRA adapter."""

    name: str
    path: str


@dataclass(frozen=True)
class ScreenAdapters:
    """Read LoRA adapters' configs against the slots (name -> path); name -> why, of those refused."""

    adapters: dict[str, str]


Question = Status | SwapInPlace | Gate | CheckAdapter | ScreenAdapters


@dataclass(frozen=True)
class StepOutputs:
    """One step's events, for every request that had one, in one message."""

    events: list[TokenEvent]


# A TokenEvent as a msgpack row: request id, token ids, finish reason, logprobs, cached tokens, and the
# pickled error of a request that failed (rare: an exception of any type).
_StepRow = tuple[str, list[int], str | None, list[TokenLogprob] | None, int | None, bytes | None]
_STEP_ROWS = msgspec.msgpack.Decoder(list[_StepRow])


def encode_step(outputs: StepOutputs) -> bytes:
    """A step's events for the pipe from the engine child. The child is the engine's one core, and
    pickling 256 TokenEvent dataclasses costs it ~270 us a step where these rows cost ~40 (and
    ~120 us to read back in the replica against ~300-500 unpickled; `bench/step_codec.py`)."""
    return _ENCODER.encode(
        [
            (e.request_id, e.token_ids, e.finish_reason, e.logprobs, e.cached_tokens, _pickled(e.error))
            for e in outputs.events
        ]
    )


def decode_step(data: bytes | memoryview) -> StepOutputs:
    return StepOutputs(
        [
            TokenEvent(request_id, token_ids, reason, None if error is None else pickle.loads(error), logprobs, cached)
            for request_id, token_ids, reason, logprobs, cached, error in _STEP_ROWS.decode(data)
        ]
    )


def _pickled(error: BaseException | None) -> bytes | None:
    return None if error is None else pickle.dumps(error, pickle.HIGHEST_PROTOCOL)


@dataclass(frozen=True)
class Ready:
    """The child's engine is loaded, captured and verified; these are its request limits."""

    limits: RequestLimits


@dataclass(frozen=True)
class Reply:
    """The answer to the oldest open question (an error it failed with is raised to its asker)."""

    value: object


@dataclass(frozen=True)
class Failed:
    """The engine could not start or its loop stopped."""

    error: BaseException


ChildMessage = StepOutputs | Ready | Reply | Failed
