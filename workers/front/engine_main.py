"""The engine child process's main (`python -m workers.front.engine_main`, started by
`engine_process.EngineChild`): it builds the engine, says READY, then runs the step loop on the
commands its parent sends. Apart from `engine_process.py` so that the parent, a replica, never
imports what the engine needs (torch, the model, the graphs)."""

from __future__ import annotations

import contextlib
import logging
import pickle
import signal
import sys
from multiprocessing.connection import Connection

from workers.front.async_engine import EngineDeadError, run_step_loop
from workers.front.engine_process import send_frame
from workers.graphs import fault_injection
from workers.protocol import (
    CheckAdapter,
    Command,
    Failed,
    Gate,
    Question,
    Ready,
    Reply,
    ScreenAdapters,
    Status,
    StepOutputs,
    Stop,
    SwapInPlace,
)
from workers.serving.engine import LLMEngine
from workers.serving.model_gate import run_gate, swap_weights_in_place

log = logging.getLogger(__name__)


def serve_engine(commands: Connection, events: Connection) -> None:
    """The child's main: read the config, build the engine (load, capture, verify), say READY with
    the request limits, then step until told to stop or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then stops us
    try:
        engine, tokenizer = LLMEngine.from_config(commands.recv())
    except BaseException as e:
        send_frame(events, Failed(_portable(e)))
        return
    fault_injection.arm_from_environment(engine.runner._replays)

    def answer(question: Question) -> object:
        nonlocal tokenizer
        if isinstance(question, Status):
            return engine.status()
        try:
            match question:
                case SwapInPlace(config):
                    tokenizer, report = swap_weights_in_place(engine, config)
                    return report
                case CheckAdapter(name, path):
                    return engine.check_adapter(name, path)
                case ScreenAdapters(adapters):
                    return engine.screen_adapters(adapters)
                case Gate():
                    return run_gate(engine, tokenizer, engine.config.gate_prompts_file)
        except Exception as e:  # the engine serves on (an in-place swap put the old weights back)
            log.error("%s failed: %s", type(question).__name__, e)
            return _portable(e)

    def receive(timeout: float | None) -> Command | None:
        try:
            if not commands.poll(timeout):
                return None
            message = commands.recv()
        except EOFError:  # the parent is gone
            return Stop()
        if not isinstance(message, Question):
            return message
        send_frame(events, Reply(answer(message)))
        return None

    send_frame(events, Ready(engine.scheduler.limits))
    try:
        run_step_loop(engine, receive, lambda step_events: send_frame(events, StepOutputs(step_events)))
    except BaseException as e:  # report, then end: the parent fails open streams and its health check
        log.exception("engine loop failed")
        with contextlib.suppress(OSError):
            send_frame(events, Failed(EngineDeadError(f"engine loop failed: {e!r}")))


def _portable(error: BaseException) -> BaseException:
    """The error itself when it survives pickling (CheckpointError, ValueError, ...), else its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


if __name__ == "__main__":
    serve_engine(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
