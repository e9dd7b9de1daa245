"""The asyncio face of the engine: `submit()` returns an async iterator of text/token events.

The step loop runs apart from the event loop: in a thread of this process (`AsyncEngine`: the CLI,
tests, tensor-parallel rank 0) or in a child process with an interpreter lock of its own
(`EngineProcess`: a serving replica). Either way this side sends commands and gets each step's
events for all requests in one call. Detokenization and stop strings happen on this side, off the
step loop; a stop string found here cancels the request in the engine. Closing a stream early (a
client that went away) cancels its request too. Every event carries what another engine needs to
continue the stream if this one dies (failover): the seed and the detokenizer's state; `submit`
with a `Resume` is that continuation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from policies.dispatch import FallbackReason
from workers.protocol import (
    Abort,
    Add,
    Call,
    Coalescing,
    Command,
    Deny,
    EngineRequest,
    EngineStatus,
    Resume,
    Stop,
    StreamEvent,
    TokenEvent,
)
from workers.serving.detokenizer import IncrementalDetokenizer
from workers.serving.sampling import InvalidRequest, SamplingParams
from workers.serving.scheduler import QueueFull, RequestLimits, Sequence, new_sequence

if TYPE_CHECKING:
    from workers.serving.engine import LLMEngine

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped; requests fail fast and health checks report it."""


class RequestFailed(RuntimeError):
    """The engine could not handle one request; the others go on."""


def apply_command(engine: LLMEngine, command: Command) -> list[TokenEvent]:
    match command:
        case Add(seq):
            engine.add_sequence(seq)
        case Call(fn, done):
            try:
                engine.launch_draw()  # fn may run the model or change the rows of the step in flight
                done.set_result(fn(engine))
            except Exception as e:
                done.set_exception(e)
        case Deny(request_id, reason):
            seq = engine.find(request_id)
            if seq is not None:
                seq.graph_denial = reason
        case Abort(request_id, reason) if engine.abort(request_id, reason):
            return [TokenEvent(request_id, [], reason)]
    return []


def apply_contained(engine: LLMEngine, command: Add | Abort | Deny | Call) -> list[TokenEvent]:
    """apply_command, where a failure ends only the request it concerns: the step loop goes on (a
    Call's failure is its caller's, through its future)."""
    try:
        return apply_command(engine, command)
    except Exception as e:
        request_id = command.seq.request_id if isinstance(command, Add) else command.request_id
        if isinstance(e, InvalidRequest | QueueFull):  # the client is told why; nothing failed here
            log.warning("request %s refused: %s", request_id, e)
            error = e
        else:
            log.exception("%s for request %s failed; ending that request", type(command).__name__, request_id)
            error = RequestFailed(f"{type(e).__name__}: {e}")
        with contextlib.suppress(Exception):
            if not isinstance(command, Add) or engine.find(request_id) is command.seq:
                engine.abort(request_id)  # what the failed command left queued, never another request under its id
        return [TokenEvent(request_id, [], "error", error)]


def run_step_loop(
    engine: LLMEngine,
    receive: Callable[[float | None], Command | None],
    emit: Callable[[list[TokenEvent]], None],
    heartbeat_s: float | None = None,
) -> None:
    """Step while there is work, applying every command that arrived in between; return on Stop.

    receive(timeout) gives the next command, or None when none came within timeout seconds (None:
    wait for one). An idle loop with heartbeat_s tells tensor-parallel followers that it lives."""
    while True:
        idle = not engine.has_work()
        command = receive(heartbeat_s if idle else 0.0)
        if command is None and idle:
            engine.heartbeat()
            continue
        events: list[TokenEvent] = []
        while command is not None:
            if isinstance(command, Stop):
                return
            events += apply_contained(engine, command)
            command = receive(0.0)
        if events:
            emit(events)
        if engine.has_work():
            events = engine.step(first_tokens=emit)  # a prefill's first tokens go out before the decode
            if events:
                emit(events)


@dataclass
class _Stream:
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # its last event (or a failure) is queued


class StreamFront(ABC):
    """The request side of an engine, on the event loop. Subclasses run the step loop, provide
    `alive` and `_send(command)`, set `error` when the loop fails, and hand events back through
    `_emit`/`_emit_failure`."""

    def __init__(self, tokenizer, limits: RequestLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.error: BaseException | None = None
        self._streams: dict[str, _Stream] = {}
        self._inflight = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def _send(self, command: Command) -> None: ...

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        graph_denial: FallbackReason | None = None,
        coalescing: Coalescing = Coalescing(),
        adapter: tuple[str, str] | None = None,
        resume: Resume | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Validate and enqueue now (raising InvalidRequest or QueueFull at once); stream later.

        The stream is read as `coalescing` says and each event carries every token that gathered
        meanwhile (the first and the last at once): fewer, larger items for a transport whose cost
        is per item. With resume, the stream goes on where another engine's left off: its events
        carry only the new tokens and text, and count every token."""
        if not self.alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        self.limits.check_prompt(prompt_ids)
        self.limits.check_params(params)
        output_ids = resume.output_ids if resume else []
        self.limits.check_continuation(prompt_ids, output_ids, params.max_tokens)
        detok = self._detokenizer(prompt_ids, params, resume)
        if request_id is not None and request_id in self._streams:
            # a second sequence under one id would orphan the first's stream and KV slot
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        with self._lock:
            if self._inflight >= self.limits.capacity:
                raise QueueFull(f"{self._inflight} requests in flight; the queue is full")
            self._inflight += 1
        self._loop = asyncio.get_running_loop()
        seq = new_sequence(prompt_ids, params, request_id, graph_denial, adapter, output_ids)
        stream = _Stream()
        self._streams[seq.request_id] = stream
        self._send(Add(seq))
        return self._stream(seq, stream, coalescing, detok, len(output_ids))

    def submit_request(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        """`submit` of a replica's typed request."""
        r = request
        return self.submit(r.prompt_ids, r.params, r.request_id, r.graph_denial, r.coalescing, r.adapter, r.resume)

    def _detokenizer(
        self, prompt_ids: list[int], params: SamplingParams, resume: Resume | None
    ) -> IncrementalDetokenizer:
        """A new request's detokenizer, or the one a continuation left off with (refused at once when
        no stream could have been in its state)."""
        if resume is None:
            return IncrementalDetokenizer(self.tokenizer, params.stop, prompt_ids)
        try:
            return IncrementalDetokenizer.restore(
                self.tokenizer, params.stop, prompt_ids, resume.output_ids, resume.detok
            )
        except ValueError as e:
            raise InvalidRequest(f"cannot continue this stream: {e}") from e

    def cancel(self, request_id: str, reason: str = "abort") -> None:
        self._send(Abort(request_id, reason))

    def set_graph_denial(self, request_id: str, reason: FallbackReason | None) -> None:
        """Change a running request's graph permission from its next step on (it keeps running)."""
        self._send(Deny(request_id, reason))

    async def _stream(
        self, seq: Sequence, stream: _Stream, coalescing: Coalescing, detok: IncrementalDetokenizer, produced: int
    ) -> AsyncIterator[StreamEvent]:
        finished, cached = False, 0
        try:
            while not finished:
                item = self._merge(await stream.events.get(), stream.events)
                cached = cached if item.cached_tokens is None else item.cached_tokens
                kept, text, hit_stop = detok.add_tokens(item.token_ids)
                token_ids = item.token_ids[:kept]  # none drawn past a stop string is returned or counted
                produced += len(token_ids)
                reason = item.finish_reason
                if hit_stop:
                    reason = "stop"
                    self.cancel(seq.request_id, reason)
                if reason is not None:
                    rest, hit_stop = ("", True) if hit_stop else detok.flush(cut_short=reason == "abort")
                    text += rest
                    reason = "stop" if hit_stop else reason  # a stop string its last characters completed
                    finished = True
                logprobs = item.logprobs[: len(token_ids)] if item.logprobs is not None else None
                yield StreamEvent(
                    seq.request_id,
                    token_ids,
                    text,
                    len(seq.prompt_ids),
                    produced,
                    reason,
                    logprobs,
                    seq.seed,
                    detok.state(),
                    cached,
                )
                wait_s = coalescing.wait_s(len(self._streams))
                if wait_s and not finished:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait_s):
                            await stream.ended.wait()
        finally:
            if not finished:
                self.cancel(seq.request_id)

    @staticmethod
    def _merge(item: TokenEvent | BaseException, events: asyncio.Queue) -> TokenEvent:
        """This event and every one already queued behind it, as one: a consumer that reads less
        often than the engine steps detokenizes and yields once per read, not once per step. One
        pass, one new event, however many were queued."""
        if isinstance(item, BaseException):
            raise item
        if item.finish_reason is not None or events.empty():
            return item
        token_ids = list(item.token_ids)
        logprobs = None if item.logprobs is None else list(item.logprobs)
        cached, last = item.cached_tokens, item
        while last.finish_reason is None and not events.empty():
            last = events.get_nowait()
            if isinstance(last, BaseException):
                raise last
            token_ids += last.token_ids
            if last.logprobs is not None or logprobs is not None:  # an abort's event has none
                logprobs = logprobs if logprobs is not None else []
                logprobs += last.logprobs or []
            cached = cached if last.cached_tokens is None else last.cached_tokens
        return TokenEvent(item.request_id, token_ids, last.finish_reason, logprobs=logprobs, cached_tokens=cached)

    def _emit(self, events: list[TokenEvent]) -> None:
        """From the step loop's side: hand one step's events to the event loop."""
        self._loop.call_soon_threadsafe(self._deliver, events)

    def _emit_failure(self, error: BaseException) -> None:
        """From the step loop's side: fail every open stream."""
        with contextlib.suppress(RuntimeError):  # the event loop may already be closed
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all, error)

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is not None:
                stream.events.put_nowait(event if event.error is None else event.error)
                if event.finish_reason is not None:
                    stream.ended.set()
                    self._close(event.request_id)

    def _close(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            with self._lock:
                self._inflight -= 1

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.events.put_nowait(error)
            stream.ended.set()
            self._close(request_id)


class AsyncEngine(StreamFront):
    """The step loop in a thread of this process."""

    def __init__(self, engine: LLMEngine, tokenizer, heartbeat_s: float | None = None) -> None:
        """heartbeat_s: with tensor parallelism, how often an idle loop tells the followers it lives."""
        super().__init__(tokenizer, engine.scheduler.limits)
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="graphserve-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._send(Stop())
        self._thread.join(timeout=10)

    async def status(self) -> EngineStatus:
        return self.engine.status()

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """fn(engine) run by the step loop between two steps (where the engine may be changed)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(Call(fn, done))
        return await asyncio.wrap_future(done)

    def _send(self, command: Command) -> None:
        self._commands.put(command)

    def _receive(self, timeout: float | None) -> Command | None:
        try:
            return self._commands.get(timeout=timeout)
        except queue.Empty:
            return None

    def _run(self) -> None:
        try:
            run_step_loop(self.engine, self._receive, self._emit, self.heartbeat_s)
            self.engine.stop_followers()
            # shut down: streams still open would otherwise wait forever for their next event
            self._emit_failure(EngineDeadError("the engine was shut down"))
        except BaseException as e:  # the loop must report any failure, then stop
            log.exception("engine loop failed")
            self.error = e
            self._emit_failure(EngineDeadError(f"engine loop failed: {e!r}"))
