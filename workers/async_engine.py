"""The asyncio face of the engine: `submit()` returns an async iterator of text/token events.

The engine steps in a thread of its own, so GPU work and host syncs never block the event loop. Each
step's events for all requests are handed to the loop in one call. Detokenization and stop strings
happen on the consumer side, off the step loop; a stop string found there cancels the request in
the engine. Closing a stream early (a client that went away) cancels its request too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from policies.dispatch import FallbackReason
from workers.detokenizer import IncrementalDetokenizer
from workers.engine import LLMEngine, TokenEvent
from workers.sampling import InvalidRequest, SamplingParams
from workers.scheduler import QueueFull, Sequence

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped; requests fail fast and health checks report it."""


@dataclass
class StreamEvent:
    """What a consumer sees: the new token ids and text of one step, and the counts so far."""

    request_id: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, tokenizer, heartbeat_s: float | None = None) -> None:
        """heartbeat_s: with tensor parallelism, how often an idle loop tells the followers it lives."""
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.tokenizer = tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._inflight = 0
        self._lock = threading.Lock()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="graphserve-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        graph_denial: FallbackReason | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Validate and enqueue now (raising InvalidRequest or QueueFull at once); stream later."""
        if not self.alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.error!r}")
        self.engine.scheduler.check_prompt(prompt_ids)
        if request_id is not None and request_id in self._streams:
            # a second sequence under one id would orphan the first's stream and KV slot
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        with self._lock:
            if self._inflight >= self.engine.scheduler.capacity:
                raise QueueFull(f"{self._inflight} requests in flight; the queue is full")
            self._inflight += 1
        self._loop = asyncio.get_running_loop()
        seq = self.engine.new_sequence(prompt_ids, params, request_id, graph_denial)
        events: asyncio.Queue = asyncio.Queue()
        self._streams[seq.request_id] = events
        self._commands.put(("add", seq))
        self._wake.set()
        return self._stream(seq, events)

    def cancel(self, request_id: str, reason: str = "abort") -> None:
        self._commands.put(("abort", (request_id, reason)))
        self._wake.set()

    def set_graph_denial(self, request_id: str, reason: FallbackReason | None) -> None:
        """Change a running request's graph permission from its next step on (it keeps running)."""
        self._commands.put(("deny", (request_id, reason)))
        self._wake.set()

    async def _stream(self, seq: Sequence, events: asyncio.Queue) -> AsyncIterator[StreamEvent]:
        detok = IncrementalDetokenizer(self.tokenizer, seq.params.stop)
        produced = 0
        finished = False
        try:
            while not finished:
                item = self._merge(await events.get(), events)
                token_ids, text, hit_stop = self._detokenize(detok, item.token_ids)
                produced += len(token_ids)
                reason = item.finish_reason
                if hit_stop:
                    reason = "stop"
                    self.cancel(seq.request_id, reason)
                if reason is not None:
                    text += "" if hit_stop else detok.flush()
                    finished = True
                yield StreamEvent(seq.request_id, token_ids, text, len(seq.prompt_ids), produced, reason)
        finally:
            if not finished:
                self.cancel(seq.request_id)

    @staticmethod
    def _detokenize(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[int], str, bool]:
        """(tokens, their text, stop string hit). With stop strings, a merged event is read token by
        token: the tokens the engine drew past a stop string are neither returned nor counted."""
        if not detok.stop or len(token_ids) <= 1:
            return token_ids, *detok.add(token_ids)
        text = ""
        for n, token in enumerate(token_ids, 1):
            piece, hit = detok.add([token])
            text += piece
            if hit:
                return token_ids[:n], text, True
        return token_ids, text, False

    @staticmethod
    def _merge(item: TokenEvent | BaseException, events: asyncio.Queue) -> TokenEvent:
        """This event and every one already queued behind it, as one: a consumer that reads less
        often than the engine steps detokenizes and yields once per read, not once per step."""
        while True:
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None or events.empty():
                return item
            following = events.get_nowait()
            if isinstance(following, BaseException):
                raise following
            item = TokenEvent(item.request_id, item.token_ids + following.token_ids, following.finish_reason)

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is not None:
                stream.put_nowait(event)
                if event.finish_reason is not None:
                    self._close(event.request_id)

    def _close(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            with self._lock:
                self._inflight -= 1

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put_nowait(error)
            self._close(request_id)

    def _apply_commands(self) -> list[TokenEvent]:
        aborted = []
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return aborted
            if kind == "add":
                self.engine.scheduler.add(arg)
            elif kind == "deny":
                seq = self.engine.scheduler.find(arg[0])
                if seq is not None:
                    seq.graph_denial = arg[1]
            elif self.engine.abort(*arg):
                aborted.append(TokenEvent(arg[0], [], arg[1]))

    def _run(self) -> None:
        try:
            while not self._stopping:
                events = self._apply_commands()
                if self.engine.has_work():
                    events += self.engine.step()
                elif not self._wake.wait(timeout=self.heartbeat_s):
                    self.engine.heartbeat()
                else:
                    self._wake.clear()
                if events:
                    self._loop.call_soon_threadsafe(self._deliver, events)
            self.engine.stop_followers()
            # shut down: streams still open would otherwise wait forever for their next event
            with contextlib.suppress(RuntimeError):  # the event loop may already be closed
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError("the engine was shut down"))
        except BaseException as e:  # the loop must report any failure, then stop
            log.exception("engine loop failed")
            self.error = e
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine loop failed: {e!r}"))
