"""The replica's engine process supervised in place (`app/shards.LocalEngine`), on CPU with the tiny
model: a killed child is started again and takes requests; a wedged one (stopped, not answering) is
noticed within the timeout, fails that health check, is killed and started again; past the restart
budget the engine is down for good and every health check fails. Also: the child inherits no
secret from the replica's environment, a status call that timed out does not break the reader, and
a reader that dies makes the engine dead instead of leaving streams waiting."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from app.shards import LocalEngine
from policies.restarts import RestartBudget
from tests.unit.engine_fixtures import Tiny, load_tiny
from workers.front.async_engine import EngineDeadError
from workers.front.engine_process import EngineProcess, child_environment
from workers.protocol import EngineRequest
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(180)
BOS = 256
LONG = SamplingParams(max_tokens=4000, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def config(tiny: Tiny) -> EngineConfig:
    return EngineConfig(model=str(tiny.model_dir), max_model_len=4096, max_num_seqs=2, device="cpu")


async def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(0.05)
    return value


async def generate(submit, request_id: str, max_tokens: int = 5) -> list[int]:
    """Greedy tokens through `submit` (an Engine's, or an engine front's submit_request)."""
    ids, params = [], SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async for event in submit(EngineRequest([BOS, 1, 2], params, request_id)):
        ids += event.token_ids
    return ids


async def test_killed_child_is_restarted_and_serves_until_the_budget_is_spent(tiny):
    engine = LocalEngine(config(tiny), RestartBudget(1, 600), timeout_s=10, start_timeout_s=120)
    await engine.start()
    try:
        expected = await generate(engine.submit, "before")
        first = engine.runner.pid
        stream = aiter(engine.submit(EngineRequest([BOS, 3], LONG, "running")))
        await anext(stream)
        os.kill(first, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert await engine.wait_ready(120)
        assert engine.runner.pid != first and engine.restarts == 1
        await engine.check()
        assert await generate(engine.submit, "after") == expected  # the same greedy tokens from the new engine

        os.kill(engine.runner.pid, signal.SIGKILL)  # a second death: the budget (1 restart) is spent
        await until(lambda: engine.failure, 30, "the engine to be given up")
        assert not await engine.wait_ready(1)
        with pytest.raises(RuntimeError, match="failed 2 times"):
            await engine.check()
        with pytest.raises(EngineDeadError):
            await generate(engine.submit, "refused")
    finally:
        engine.runner.shutdown()


async def test_a_restart_whose_start_fails_counts_and_the_next_one_serves(tiny, monkeypatch):
    """A child that dies, then a new one that fails to start: both restarts are charged to the
    budget and counted (a replica given up on shows every restart it was allowed), and the third
    child serves."""
    engine = LocalEngine(config(tiny), RestartBudget(2, 600), timeout_s=10, start_timeout_s=120)
    await engine.start()
    spawn, attempts = engine._spawn, []

    def failing_once(child=None):
        attempts.append(child)
        if len(attempts) == 1:
            raise EngineDeadError("the engine process was not READY in time; killed")
        return spawn(child)

    monkeypatch.setattr(engine, "_spawn", failing_once)
    try:
        first = engine.runner.pid
        os.kill(first, signal.SIGKILL)
        await until(lambda: not engine.runner.alive, 30, "the child's death to be seen")
        assert await engine.wait_ready(120)
        assert len(attempts) == 2 and engine.runner.pid != first
        assert engine.restarts == 2 and engine.failure is None
        assert await generate(engine.submit, "after") == await generate(engine.submit, "again")
    finally:
        engine.runner.shutdown()


async def test_wedged_child_fails_a_check_then_is_restarted(tiny):
    engine = LocalEngine(config(tiny), RestartBudget(3, 600), timeout_s=1.0, start_timeout_s=120)
    await engine.start()
    try:
        wedged = engine.runner.pid
        os.kill(wedged, signal.SIGSTOP)  # alive, but answers nothing
        with pytest.raises(EngineDeadError, match="did not answer"):
            await asyncio.wait_for(engine.check(), 10)
        assert await engine.wait_ready(120) and engine.runner.pid != wedged
        await engine.check()
        assert await generate(engine.submit, "after")
    finally:
        engine.runner.shutdown()


async def test_status_that_timed_out_leaves_the_reader_working(tiny):
    """A status call given up on (its future cancelled) must not kill the reader when the answer
    comes later: the engine stays alive and answers the next call."""
    process = EngineProcess(config(tiny), tiny.tokenizer)
    try:
        os.kill(process.pid, signal.SIGSTOP)
        with pytest.raises(TimeoutError):
            await process.status(0.5)
        os.kill(process.pid, signal.SIGCONT)
        status = await process.status(10)
        assert status.state == "READY" and process.alive
        assert await generate(process.submit_request, "still-serving")
    finally:
        process.shutdown()


async def test_dead_reader_makes_the_engine_dead_and_ends_streams(tiny):
    """Fault injection: handing events to the event loop fails (as with a closed loop). The engine
    must count as dead, its child be killed, the waiting stream end with an error, on_exit be told."""
    exits = []
    process = EngineProcess(config(tiny), tiny.tokenizer, on_exit=exits.append)
    try:

        def broken_emit(events):
            raise RuntimeError("Event loop is closed")

        process._emit = broken_emit  # before the request: its first events must not be handed on first
        stream = aiter(process.submit([BOS, 4], LONG, "victim"))
        with pytest.raises(EngineDeadError, match="reader failed"):
            await asyncio.wait_for(anext(stream), 30)
        await until(lambda: exits, 10, "on_exit to be called")
        assert not process.alive
        await until(lambda: process.process.poll() is not None, 10, "the child to be killed")
    finally:
        process.shutdown()


def test_child_environment_keeps_no_secret(tiny, monkeypatch):
    """The child gets paths and library settings, never the replica's secrets; checked on a real
    child's /proc environ as well as on the function."""
    names = (
        "GRAPHSERVE_API_KEYS",
        "GRAPHSERVE_ADMIN_TOKEN",
        "GRAPHSERVE_ADMIN_TOKENS",
        "HF_TOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "RAY_AUTH_TOKEN",
        "MY_SERVICE_PASSWORD",
    )
    secrets = {name: f"s3cret-{i}-do-not-leak" for i, name in enumerate(names)}
    kept = {"CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "1", "HF_HOME": "/tmp/hf"}
    for name, value in {**secrets, **kept}.items():
        monkeypatch.setenv(name, value)
    env = child_environment(dict(os.environ))
    assert not set(secrets) & set(env)
    assert kept.items() <= env.items() and env["PATH"] == os.environ["PATH"]
    process = EngineProcess(config(tiny), tiny.tokenizer)
    try:
        raw = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        names = {entry.split(b"=", 1)[0].decode() for entry in raw if entry}
        assert not set(secrets) & names
        assert set(kept) <= names
        assert not any(value.encode() in raw_entry for value in secrets.values() for raw_entry in raw)
    finally:
        process.shutdown()
