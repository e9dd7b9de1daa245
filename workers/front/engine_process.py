"""The engine's step loop in a child process: how a serving replica runs its engine.

A replica's event loop streams every request's tokens through Ray. A step loop in a thread of that
process shares its interpreter lock and waits for it between steps: on the H200, 32 streams got
0.6x the engine's own tokens/s that way (`bench/results/serve_e2e_h200.md`). In a process of its
own the step loop has a lock to itself. Commands go down one pipe; each step's events for all
requests come back up another as one message. The child exits when the parent goes away (its end of
the command pipe closes), so it never outlives its replica holding the GPU. It is a fresh
interpreter (`python -m workers.front.engine_main`), not a fork: a forked child cannot use CUDA, and
nothing of the parent's main module runs again in it. This side imports no torch: only the child
loads the engine. What the child sends is one frame per message, its first byte saying how the rest
is encoded: a step's events as msgpack rows (`encode_step`), anything else pickled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import pickle
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection

from workers.front.async_engine import EngineDeadError, StreamFront
from workers.graphs import fault_injection
from workers.modeling.default_model import DEFAULT_MODEL_ENV
from workers.protocol import (
    ChildMessage,
    Command,
    EngineStatus,
    Failed,
    Question,
    Ready,
    Reply,
    Status,
    StepOutputs,
    Stop,
    decode_step,
    encode_step,
)
from workers.serving.engine_config import EngineConfig

log = logging.getLogger(__name__)

EXIT_WAIT_S = 10.0
STEP_FRAME, PICKLED_FRAME = b"S", b"P"  # the first byte of a frame from the child

# What the child takes from the replica's environment: paths, locale, and the settings of the
# accelerator and the libraries it runs. Anything else (API keys, admin tokens, cloud credentials)
# stays behind, and so does any variable whose name says it holds a secret.
CHILD_ENV_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TERM",
        "LD_LIBRARY_PATH",
        "VIRTUAL_ENV",
        "PYTHONHASHSEED",
        "PYTHONUNBUFFERED",
        "XDG_CACHE_HOME",
        "GRAPHSERVE_CACHE",
        DEFAULT_MODEL_ENV,
        fault_injection.VARIABLE,
    }
)
CHILD_ENV_PREFIXES = (
    "LC_",
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "CUBLAS",
    "CUDNN_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
)
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")


def child_environment(parent: dict[str, str]) -> dict[str, str]:
    """The engine child's environment: what it needs of `parent`, plus our import path."""
    env = {
        name: value
        for name, value in parent.items()
        if (name in CHILD_ENV_NAMES or name.startswith(CHILD_ENV_PREFIXES))
        and not any(word in name.upper() for word in SECRET_WORDS)
    }
    env["PYTHONPATH"] = os.pathsep.join(sys.path)  # whatever this process can import
    return env


class EngineChild:
    """An engine process told its config, not yet waited for: it imports torch and the engine and
    loads the model while its parent does something else (a replica asks the controller what to
    serve and reads the tokenizer). `discard` ends one that is not wanted after all."""

    def __init__(self, config: EngineConfig) -> None:
        child_commands, commands = os.pipe()
        events, child_events = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers.front.engine_main", str(child_commands), str(child_events)],
            pass_fds=(child_commands, child_events),
            env=child_environment(dict(os.environ)),
        )
        os.close(child_commands)  # the child's ends live in the child now: EOF means the other side is gone
        os.close(child_events)
        self.commands = Connection(commands, readable=False)
        self.events = Connection(events, writable=False)
        self.config = config
        self.commands.send(config)

    def discard(self) -> None:
        """End a child that will not be used."""
        self.process.kill()
        self.process.wait()
        self.commands.close()
        self.events.close()


class EngineProcess(StreamFront):
    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        on_exit: Callable[[BaseException], None] | None = None,
        start_timeout_s: float | None = None,
        child: EngineChild | None = None,
    ) -> None:
        """Return once the child's engine is READY (loaded, captured, verified), or raise what
        stopped it (a child not READY within start_timeout_s is killed). `child`: one started
        earlier with this config; None starts one now. on_exit is called from the reader thread
        with the cause when the child stops without being told to."""
        child = child or EngineChild(config)
        if child.config != config:
            raise ValueError("the engine child was started with another config")
        self.process, self._commands, self._events = child.process, child.commands, child.events
        if not self._events.poll(start_timeout_s):
            self.process.kill()
            self.process.wait()
            raise EngineDeadError(f"the engine process was not READY within {start_timeout_s:g} s; killed")
        message = self._receive_from_child()
        if not isinstance(message, Ready):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(EXIT_WAIT_S)
            raise message.error
        super().__init__(tokenizer, message.limits)
        self.on_exit = on_exit
        self._stopping = False
        self._send_lock = threading.Lock()
        self._replies: deque[concurrent.futures.Future] = deque()
        self._reader = threading.Thread(target=self._read, name="graphserve-engine-events", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and self.error is None

    @property
    def pid(self) -> int:
        return self.process.pid

    async def status(self, timeout_s: float | None = None) -> EngineStatus:
        """The engine's status, answered by the child between two steps; TimeoutError when it does
        not answer within timeout_s (a wedged child)."""
        return await self.ask(Status(), timeout_s)

    async def ask(self, question: Question, timeout_s: float | None = None):
        """The child's answer, given between two steps; an error it answers with is raised here."""
        reply: concurrent.futures.Future = concurrent.futures.Future()
        with self._send_lock:
            if not self.alive:
                raise EngineDeadError(f"the engine process has stopped: {self.error!r}")
            self._replies.append(reply)
            try:
                self._commands.send(question)
            except OSError as e:  # the child is gone; the reader reports it
                raise EngineDeadError(f"the engine process has stopped: {e!r}") from e
        return await asyncio.wait_for(asyncio.wrap_future(reply), timeout_s)

    def kill(self) -> None:
        """End a child that no longer answers: dead from now on (before its exit is even seen); the
        reader then reports it like any other death."""
        self.error = self.error or EngineDeadError("the engine process was killed")
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def shutdown(self) -> None:
        self._stopping = True
        self._send(Stop())
        try:
            self.process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _send(self, command: Command) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # a dead child is reported by the reader
            self._commands.send(command)

    def _receive_from_child(self) -> ChildMessage:
        try:
            return read_frame(self._events.recv_bytes())
        except EOFError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(EXIT_WAIT_S)
            return Failed(EngineDeadError(f"the engine process exited (exit code {self.process.returncode})"))

    def _read(self) -> None:
        """Hand the child's messages on until it stops. Whatever ends this thread (the child's exit,
        or a failure here such as a closed event loop) makes the engine dead: the child is killed,
        every waiting stream and status call gets the error, and on_exit is told."""
        try:
            while True:
                message = self._receive_from_child()
                if isinstance(message, StepOutputs):
                    self._emit(message.events)
                elif isinstance(message, Reply):
                    reply = self._replies.popleft()
                    if reply.set_running_or_notify_cancel():  # False: its caller gave up waiting
                        if isinstance(message.value, BaseException):
                            reply.set_exception(message.value)
                        else:
                            reply.set_result(message.value)
                else:
                    payload = message.error
                    break
        except BaseException as e:
            log.exception("the engine's event reader failed; killing the engine process")
            payload = EngineDeadError(f"the engine's event reader failed: {e!r}")
            self.kill()
        if self._stopping:
            payload = EngineDeadError("the engine was shut down")
        else:
            log.error("engine process (pid %d) failed: %s", self.pid, payload)
        with self._send_lock:
            self.error = payload
            while self._replies:
                reply = self._replies.popleft()
                if reply.set_running_or_notify_cancel():
                    reply.set_exception(payload)
        self._emit_failure(payload)
        if self.on_exit is not None and not self._stopping:
            try:
                self.on_exit(payload)
            except Exception:
                log.exception("the engine's exit handler failed")


def send_frame(events: Connection, message: ChildMessage) -> None:
    """One message from the child (`read_frame` reads it)."""
    if isinstance(message, StepOutputs):
        events.send_bytes(STEP_FRAME + encode_step(message))
    else:
        events.send_bytes(PICKLED_FRAME + pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def read_frame(data: bytes) -> ChildMessage:
    body = memoryview(data)[1:]
    return decode_step(body) if data[:1] == STEP_FRAME else pickle.loads(body)
