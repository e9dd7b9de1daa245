"""The engine's step loop in a child process: how a serving replica runs its engine.

A replica's event loop streams every request's tokens through Ray. A step loop in a thread of that
process shares its interpreter lock and waits for it between steps: on the H200, 32 streams got
0.6x the engine's own tokens/s that way (`bench/results/serve_e2e_h200.md`). In a process of its
own the step loop has a lock to itself. Commands go down one pipe; each step's events for all
requests come back up another as one message. The child exits when the parent goes away (its end of
the command pipe closes), so it never outlives its replica holding the GPU. It is a fresh
interpreter (`python -m workers.engine_process`), not a fork: a forked child cannot use CUDA, and
nothing of the parent's main module runs again in it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections import deque
from multiprocessing.connection import Connection

from workers.async_engine import STOP, Command, EngineDeadError, StreamFront, run_step_loop
from workers.engine import EngineConfig, LLMEngine

log = logging.getLogger(__name__)

# Messages from the child: (kind, payload).
READY, EVENTS, STATUS, FAILED = "ready", "events", "status", "failed"
EXIT_WAIT_S = 10.0


class EngineProcess(StreamFront):
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        """Start the child and return once its engine is READY (loaded, captured, verified), or
        raise what stopped it."""
        child_commands, commands = os.pipe()
        events, child_events = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # whatever this process can import
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers.engine_process", str(child_commands), str(child_events)],
            pass_fds=(child_commands, child_events), env=env,
        )  # fmt: skip
        os.close(child_commands)  # the child's ends live in the child now: EOF means the other side is gone
        os.close(child_events)
        self._commands = Connection(commands, readable=False)
        self._events = Connection(events, writable=False)
        self._commands.send(config)
        kind, payload = self._receive_from_child()
        if kind != READY:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(EXIT_WAIT_S)
            raise payload
        super().__init__(tokenizer, payload)
        self._stopping = False
        self._send_lock = threading.Lock()
        self._status_replies: deque[concurrent.futures.Future] = deque()
        self._reader = threading.Thread(target=self._read, name="graphserve-engine-events", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and self.error is None

    async def status(self) -> dict:
        """The engine's status, answered by the child between two steps."""
        reply: concurrent.futures.Future = concurrent.futures.Future()
        with self._send_lock:
            if not self.alive:
                raise EngineDeadError(f"the engine process has stopped: {self.error!r}")
            self._status_replies.append(reply)
            self._commands.send((STATUS, None))
        return await asyncio.wrap_future(reply)

    def shutdown(self) -> None:
        self._stopping = True
        self._send((STOP, None))
        try:
            self.process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _send(self, command: Command) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # a dead child is reported by the reader
            self._commands.send(command)

    def _receive_from_child(self) -> tuple[str, object]:
        try:
            return self._events.recv()
        except EOFError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(EXIT_WAIT_S)
            return FAILED, EngineDeadError(f"the engine process exited (exit code {self.process.returncode})")

    def _read(self) -> None:
        while True:
            kind, payload = self._receive_from_child()
            if kind == EVENTS:
                self._emit(payload)
            elif kind == STATUS:
                self._status_replies.popleft().set_result(payload)
            else:
                break
        if self._stopping:
            payload = EngineDeadError("the engine was shut down")
        else:
            log.error("engine process failed: %s", payload)
        with self._send_lock:
            self.error = payload
            while self._status_replies:
                self._status_replies.popleft().set_exception(payload)
        self._emit_failure(payload)


def serve_engine(commands: Connection, events: Connection) -> None:
    """The child's main: read the config, build the engine (load, capture, verify), say READY with
    the request limits, then step until told to stop or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then stops us
    try:
        engine, _ = LLMEngine.from_config(commands.recv())
    except BaseException as e:
        events.send((FAILED, _portable(e)))
        return

    def receive(timeout: float | None) -> Command | None:
        try:
            if not commands.poll(timeout):
                return None
            command = commands.recv()
        except EOFError:  # the parent is gone
            return STOP, None
        if command[0] != STATUS:
            return command
        events.send((STATUS, engine.status()))
        return None

    events.send((READY, engine.scheduler.limits))
    try:
        run_step_loop(engine, receive, lambda step_events: events.send((EVENTS, step_events)))
    except BaseException as e:  # report, then end: the parent fails open streams and its health check
        log.exception("engine loop failed")
        with contextlib.suppress(OSError):
            events.send((FAILED, EngineDeadError(f"engine loop failed: {e!r}")))


def _portable(error: BaseException) -> BaseException:
    """The error itself when it survives pickling (CheckpointError, ValueError, ...), else its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


if __name__ == "__main__":
    serve_engine(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
