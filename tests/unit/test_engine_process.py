"""The step loop in a child process (how a replica runs its engine), on CPU with the tiny model:
the same tokens as the in-process engine, coalesced reads that still end at once, status from the
child, and every way the child can stop (killed, shut down, bad checkpoint, parent gone)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing.connection import Pipe
from pathlib import Path

import pytest

from tests.unit.engine_fixtures import Tiny, load_tiny, new_engine, run_alone
from workers.front.async_engine import EngineDeadError
from workers.front.engine_process import EngineChild, EngineProcess, read_frame, send_frame
from workers.modeling.config import CheckpointError
from workers.protocol import Coalescing, Failed, Ready, Reply, StepOutputs, TokenEvent
from workers.serving.engine_config import EngineConfig
from workers.serving.json_schema import InvalidSchema, canonical_schema
from workers.serving.sampling import InvalidRequest, SamplingParams, TokenLogprob

pytestmark = pytest.mark.timeout(120)
BOS = 256
# Long enough to be still running whenever a test acts on it (thousands of tiny-model steps).
LONG = SamplingParams(max_tokens=4000, ignore_eos=True)
LONG_LEN = 4096


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def config(tiny: Tiny, **overrides) -> EngineConfig:
    return EngineConfig(
        **{"model": str(tiny.model_dir), "max_model_len": tiny.max_model_len, "device": "cpu"} | overrides
    )


@pytest.fixture(scope="module")
def shared(tiny):
    """One child for the tests that leave it healthy (starting one costs a few seconds on CPU),
    started ahead of the EngineProcess that waits for it, as a replica starts it."""
    ahead = config(tiny, max_num_seqs=4)
    engine = EngineProcess(ahead, tiny.tokenizer, child=EngineChild(ahead))
    yield engine
    engine.shutdown()


def exited(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def drain(stream) -> tuple[list[int], str, str | None, int]:
    ids, text, reason, events = [], "", None, 0
    async for event in stream:
        ids += event.token_ids
        text += event.text
        reason = event.finish_reason
        events += 1
    return ids, text, reason, events


def requests(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [BOS] + [rng.randrange(256) for _ in range(rng.randint(1, 20))]
        sampled = dict(temperature=0.8, top_p=0.9, seed=rng.randrange(2**32)) if i % 2 else dict(temperature=0.0)
        out.append((prompt, SamplingParams(max_tokens=rng.randint(1, 30), **sampled)))
    return out


async def test_streams_match_the_in_process_engine(tiny, shared):
    """7 concurrent greedy and seeded-sampled requests through 4 slots in the child give exactly
    the tokens, text and finish reason each gives alone in this process."""
    batch = requests(0, 7)
    results = await asyncio.wait_for(asyncio.gather(*(drain(shared.submit(p, s)) for p, s in batch)), 60)
    for (prompt, params), (ids, text, reason, _) in zip(batch, results):
        assert (ids, reason) == run_alone(tiny, prompt, params)
        assert text == tiny.tokenizer.decode(ids, skip_special_tokens=True)


async def test_penalties_and_logprobs_cross_the_pipe(tiny, shared):
    """A request with penalties, a logit_bias and logprobs streams from the child the tokens and,
    token by token, the logprobs the same request gets from an engine in this process."""
    params = SamplingParams(
        max_tokens=12,
        temperature=0.8,
        seed=5,
        ignore_eos=True,
        presence_penalty=1.0,
        repetition_penalty=1.3,
        logit_bias=((70, 4.0),),
        logprobs=3,
    )
    prompt = [BOS, 9, 8, 7]
    ids, logprobs = [], []
    async for event in shared.submit(prompt, params, coalescing=Coalescing(0.01)):
        ids += event.token_ids
        logprobs += event.logprobs
    engine = new_engine(tiny, max_num_seqs=1)
    seq = engine.add_request(prompt, params)
    local = []
    while engine.has_work():
        local += [lp for event in engine.step() for lp in event.logprobs]
    assert ids == seq.output_ids and len(logprobs) == len(local) == 12
    for got, want in zip(logprobs, local):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


async def test_a_schema_is_compiled_and_followed_in_the_child_and_its_refusal_crosses_back(tiny, shared):
    """The child compiles a response_format's schema against its own tokenizer: the request draws
    there what it draws in this process, and a schema it cannot compile comes back as the
    InvalidSchema (naming response_format) the replica answers 400 with."""
    schema = canonical_schema({"type": "array", "items": {"enum": ["ab", "c"]}, "maxItems": 4})
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, json_schema=schema)
    ids, text, reason, _ = await asyncio.wait_for(drain(shared.submit([BOS, 5, 6], params)), 30)
    assert (ids, reason) == run_alone(tiny, [BOS, 5, 6], params) and reason == "stop"
    assert text.startswith("[") and text.endswith("]")
    refused = SamplingParams(json_schema='{"type":"strin"}')
    with pytest.raises(InvalidSchema, match="strin") as info:
        await asyncio.wait_for(drain(shared.submit([BOS, 5, 6], refused)), 30)
    assert info.value.param == "response_format"


async def test_status_comes_from_the_child(shared):
    """status() is the child's engine status; its counters move with the tokens streamed."""
    before = (await shared.status()).stats
    ids, *_ = await drain(shared.submit([BOS, 1, 2], SamplingParams(max_tokens=9, ignore_eos=True)))
    after = await shared.status()
    assert after.state == "READY" and after.max_model_len == 64
    assert after.stats["generated_tokens"] - before["generated_tokens"] == len(ids) == 9


async def test_coalesced_reads_gather_tokens_and_end_at_once(shared):
    """With a read interval, a stream yields far fewer events than tokens, and the last one comes
    as soon as the request ends, not after the rest of the interval."""
    params, interval_s = SamplingParams(max_tokens=40, ignore_eos=True), 0.25
    t0 = time.monotonic()
    ids, _, reason, events = await drain(shared.submit([BOS, 3], params, coalescing=Coalescing(interval_s)))
    elapsed_s = time.monotonic() - t0
    # the first read at once, then one per interval (the last at the end): however slow the steps
    assert len(ids) == 40 and reason == "length" and events <= 2 + elapsed_s / interval_s and events < len(ids)
    t0 = time.monotonic()
    ids, _, reason, events = await drain(
        shared.submit([BOS, 4], SamplingParams(max_tokens=3), coalescing=Coalescing(30.0))
    )
    # the first token at once and the rest at the end (one event when all three are there before the first read)
    assert time.monotonic() - t0 < 10 and events <= 2


async def test_under_an_item_budget_many_streams_send_fewer_larger_items(shared):
    """With items_per_s, all open streams together keep to the budget: each stream waits (streams
    open) / budget after an item, 0.8 s while all 16 are open and less as others end, so between
    their first and last items the streams send at most `budget` items a second together, and
    each stream's tokens come in few items (none lost), however fast the engine steps."""
    budget = Coalescing(0.0, items_per_s=20.0)  # 16 streams: an item per stream every 0.8 s
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def timed(i: int):
        t0 = time.monotonic()
        ids, _, reason, events = await drain(shared.submit([BOS, 5, i], params, coalescing=budget))
        return len(ids), reason, events, time.monotonic() - t0

    results = await asyncio.wait_for(asyncio.gather(*(timed(i) for i in range(16))), 120)
    for tokens, reason, events, _ in results:
        assert (tokens, reason) == (50, "length") and events <= tokens // 2
    between = sum(events - 2 for _, _, events, _ in results)  # all but each stream's first and last
    seconds = max(s for *_, s in results)
    assert between <= budget.items_per_s * seconds + len(results), (between, seconds)  # + one pause each in flight


def test_the_item_budget_spreads_items_only_under_load():
    budget = Coalescing(0.02, items_per_s=2000.0)
    assert budget.wait_s(1) == budget.wait_s(40) == 0.02  # below the budget: the interval
    assert budget.wait_s(256) == pytest.approx(0.128)  # 256 streams share 2000 items/s
    assert Coalescing(0.02).wait_s(10_000) == 0.02


async def test_closing_a_stream_frees_its_slot_in_the_child(tiny):
    """One slot: a long request whose consumer leaves after its first event is aborted in the
    child, so the next request runs instead of waiting for 60 tokens."""
    engine = EngineProcess(config(tiny, max_num_seqs=1, max_model_len=LONG_LEN), tiny.tokenizer)
    try:
        stream = engine.submit([BOS, 5], LONG)
        await anext(stream)
        await stream.aclose()
        ids, _, reason, _ = await asyncio.wait_for(drain(engine.submit([BOS, 6], SamplingParams(max_tokens=2))), 30)
        assert reason in ("length", "stop")
        finished = (await engine.status()).stats["finished_requests"]
        assert finished.get("abort") == 1
    finally:
        engine.shutdown()


async def test_killed_child_fails_streams_submit_and_status(tiny):
    """The child killed mid-stream: the open stream raises EngineDeadError naming the exit, the
    front is no longer alive, and new requests and status fail fast."""
    engine = EngineProcess(config(tiny, max_num_seqs=2, max_model_len=LONG_LEN), tiny.tokenizer)
    stream = engine.submit([BOS, 7], LONG, coalescing=Coalescing(0.01))
    await anext(stream)
    os.kill(engine.process.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="exit code -9"):
        await asyncio.wait_for(drain(stream), 30)
    assert not engine.alive
    with pytest.raises(EngineDeadError):
        engine.submit([BOS, 1], SamplingParams())
    with pytest.raises(EngineDeadError):
        await engine.status()


async def test_shutdown_stops_the_child_and_fails_open_streams(tiny):
    engine = EngineProcess(config(tiny, max_num_seqs=2, max_model_len=LONG_LEN), tiny.tokenizer)
    stream = engine.submit([BOS, 8], LONG, coalescing=Coalescing(0.01))
    await anext(stream)
    engine.shutdown()
    assert engine.process.returncode == 0
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(drain(stream), 30)
    assert not engine.alive


def test_bad_checkpoint_raises_the_childs_error(tmp_path, tiny):
    """A checkpoint the child cannot load raises the child's own error in the parent."""
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        EngineProcess(EngineConfig(model=str(tmp_path), device="cpu"), tiny.tokenizer)


def test_child_exits_when_its_parent_dies(tiny, tmp_path):
    """A parent killed without any cleanup (SIGKILL) leaves no engine behind holding the device."""
    script = textwrap.dedent(f"""
        from workers.serving.engine_config import EngineConfig
        from workers.front.engine_process import EngineProcess, read_frame, send_frame
        engine = EngineProcess(EngineConfig(model={str(tiny.model_dir)!r}, max_model_len=64, device="cpu"), None)
        print(engine.process.pid, flush=True)
        import time; time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        child = int(parent.stdout.readline())
        assert not exited(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while not exited(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert exited(child)
    finally:
        parent.kill()


def test_a_child_started_ahead_and_not_wanted_is_discarded(tiny):
    """A child started ahead for a config the replica then does not serve (a swap target named
    another model) is ended, and an EngineProcess refuses one started for another config."""
    child = EngineChild(config(tiny))
    assert not exited(child.process.pid)
    with pytest.raises(ValueError, match="another config"):
        EngineProcess(config(tiny, max_num_seqs=2), tiny.tokenizer, child=child)
    child.discard()
    assert exited(child.process.pid)


def test_every_kind_of_message_crosses_the_pipe_as_it_was_sent():
    """The child's frames (a step's events as msgpack rows, the rest pickled) read back equal to what
    was sent: logprobs (an impossible token's -inf too), cached-token counts said and not, and the
    error a request ended with, its type and the field it names kept."""
    refused = InvalidRequest("too many tokens")
    refused.param = "max_tokens"
    step = StepOutputs(
        [
            TokenEvent("a", [5, 6], None, cached_tokens=None),
            TokenEvent(
                "b", [7], "length", logprobs=[TokenLogprob(-0.5, [(7, -0.5), (8, float("-inf"))])], cached_tokens=3
            ),
            TokenEvent("c", [], "error", refused),
        ]
    )
    receiving, sending = Pipe(duplex=False)
    for message in (step, Reply({"state": "READY"}), Reply(refused), Failed(EngineDeadError("gone")), Ready(None)):
        send_frame(sending, message)
        got = read_frame(receiving.recv_bytes())
        assert type(got) is type(message)
        if isinstance(message, StepOutputs):
            assert [(e.request_id, e.token_ids, e.finish_reason, e.logprobs, e.cached_tokens) for e in got.events] == [
                (e.request_id, e.token_ids, e.finish_reason, e.logprobs, e.cached_tokens) for e in message.events
            ]
            error = got.events[2].error
            assert isinstance(error, InvalidRequest) and str(error) == "too many tokens" and error.param == "max_tokens"
        elif isinstance(message, Reply) and isinstance(message.value, BaseException):
            assert isinstance(got.value, InvalidRequest) and got.value.param == "max_tokens"
        else:
            assert repr(got) == repr(message)
