"""The engine end to end on CPU with the embedded tiny model: continuous batching gives the same
tokens as running alone, limits and stops end requests correctly, cancellation and failures free
resources, and the stats agree with what was streamed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from policies.dispatch import FallbackReason
from tests.unit.engine_fixtures import Tiny, load_tiny, new_engine, run_alone, run_sync
from workers.front.async_engine import AsyncEngine, EngineDeadError, apply_contained
from workers.protocol import Add, Coalescing
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import InvalidRequest, SamplingParams
from workers.serving.scheduler import QueueFull, new_sequence

pytestmark = pytest.mark.timeout(60)
BOS = 256


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


@pytest.fixture
async def start(tiny):
    """start(engine) -> a running AsyncEngine; every one is shut down after the test."""
    runners: list[AsyncEngine] = []

    def make(engine: LLMEngine) -> AsyncEngine:
        runner = AsyncEngine(engine, tiny.tokenizer).start()
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.shutdown()
        assert not runner._thread.is_alive()


@dataclass
class Result:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    events: int = 0


async def collect(stream, first_event: asyncio.Event | None = None) -> Result:
    """Drain a stream, checking that only its last event carries a finish reason."""
    r = Result()
    async for ev in stream:
        assert r.reason is None, "event after the final one"
        r.ids += ev.token_ids
        r.text += ev.text
        r.reason = ev.finish_reason
        r.prompt_tokens, r.completion_tokens = ev.prompt_tokens, ev.completion_tokens
        r.events += 1
        if first_event is not None:
            first_event.set()
    return r


def prompt(rng: random.Random, n: int) -> list[int]:
    return [BOS] + [rng.randrange(256) for _ in range(n - 1)]


def slow_steps(monkeypatch, engine: LLMEngine, seconds: float = 0.02) -> None:
    """Make each engine step take a while, so a request is still running when a test acts on it."""
    step = engine.step

    def slow(first_tokens=None):
        events = step(first_tokens)
        time.sleep(seconds)
        return events

    monkeypatch.setattr(engine, "step", slow)


async def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def all_slots_free(engine: LLMEngine) -> bool:
    return sorted(engine.scheduler.free_slots) == list(range(engine.config.max_num_seqs))


def mixed_requests(seed: int, n: int, **params) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [
        (prompt(rng, rng.randint(2, 30)), SamplingParams(max_tokens=rng.randint(1, 25), **params)) for _ in range(n)
    ]


# ---------------------------------------------------------------- batching equals running alone


def test_startup_prefill_warms_only_the_scratch_slot(tiny):
    """The prefill run before READY (so the first request does not pay one-time set-up) writes only
    the scratch page and counts nowhere."""
    engine = new_engine(tiny, max_num_seqs=3)
    cache = engine.cache
    assert not cache.k[:, 1:].any() and not cache.v[:, 1:].any()
    assert cache.k[:, 0].any() and not cache.block_table.any()
    snap = engine.stats.snapshot()
    assert snap["prefill_steps"] == snap["prompt_tokens"] == snap["busy_s"]["prefill"] == 0


def test_sync_batching_matches_solo_runs(tiny):
    """16 greedy requests of different lengths through 6 slots (queueing, slot reuse with stale KV
    from the previous owner) produce exactly the tokens each produces alone."""
    requests = mixed_requests(0, 16, temperature=0.0)
    engine = new_engine(tiny, max_num_seqs=6)
    seqs = run_sync(engine, requests)
    for (p, params), s in zip(requests, seqs):
        assert (s.output_ids, s.finish_reason) == run_alone(tiny, p, params)
    assert all_slots_free(engine) and not engine.scheduler.waiting and not engine.scheduler.running
    assert max(engine.stats.snapshot()["decode_batch_sizes"]) == 6


async def test_concurrent_streams_match_solo_runs(tiny, start):
    """16 concurrent greedy streams through AsyncEngine with 6 slots: every stream ends with the
    solo run's finish reason, token ids, counts and text; batches of several rows really formed,
    slots were reused (at least 3 admission rounds), and every slot is free at the end."""
    requests = mixed_requests(1, 16, temperature=0.0)
    solo = [run_alone(tiny, p, params) for p, params in requests]
    engine = new_engine(tiny, max_num_seqs=6)
    runner = start(engine)
    results = await asyncio.wait_for(
        asyncio.gather(*(collect(runner.submit(p, params)) for p, params in requests)), timeout=30
    )
    for (p, params), (ids, reason), r in zip(requests, solo, results):
        assert r.ids == ids
        assert r.reason == reason
        assert r.completion_tokens == len(ids) and r.prompt_tokens == len(p)
        assert r.text == tiny.tokenizer.decode(ids, skip_special_tokens=True)
        if reason == "length":
            assert len(ids) == params.max_tokens
    snap = engine.stats.snapshot()
    sizes = snap["decode_batch_sizes"]
    assert max(sizes) > 1 and max(sizes) <= 6
    assert snap["prefill_steps"] >= 3  # 16 requests through 6 slots: at least 3 admission rounds
    assert sum(snap["finished_requests"].values()) == 16
    await wait_until(lambda: all_slots_free(engine))


async def test_seeded_sampling_same_alone_or_batched(tiny, start):
    """A seeded sampled request draws the same tokens alone and batched with other sampled,
    greedy and unseeded requests; two copies of it in one batch agree; another seed differs."""
    rng = random.Random(2)
    p = prompt(rng, 9)
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    other_seed = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=4321, ignore_eos=True)
    mates = [
        (prompt(rng, 5), SamplingParams(max_tokens=15, temperature=1.3, seed=7)),
        (prompt(rng, 17), SamplingParams(max_tokens=25, temperature=0.0)),
        (prompt(rng, 3), SamplingParams(max_tokens=12, temperature=0.7, top_k=3)),
        (prompt(rng, 11), SamplingParams(max_tokens=30, temperature=1.0, top_p=0.5, seed=2**63 - 1)),
    ]
    alone, _ = run_alone(tiny, p, params)
    assert len(alone) == 20
    runner = start(new_engine(tiny, max_num_seqs=4))
    batch = [mates[0], (p, params), mates[1], mates[2], (p, params), mates[3], (p, other_seed)]
    results = await asyncio.wait_for(asyncio.gather(*(collect(runner.submit(q, s)) for q, s in batch)), 30)
    assert results[1].ids == alone
    assert results[4].ids == alone
    assert results[6].ids != alone
    assert results[0].ids == run_alone(tiny, *mates[0])[0]
    assert results[5].ids == run_alone(tiny, *mates[3])[0]


# ---------------------------------------------------------------- limits and stops


@pytest.mark.parametrize("max_tokens", [1, 2, 9])
def test_max_tokens_respected(tiny, max_tokens):
    """A request yields exactly max_tokens tokens (EOS ignored) and finishes with 'length'."""
    engine = new_engine(tiny, max_num_seqs=2)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (s,) = run_sync(engine, [(prompt(random.Random(3), 6), params)])
    assert len(s.output_ids) == max_tokens and s.finish_reason == "length"


@pytest.mark.parametrize("prompt_len", [60, 63, 64])
def test_max_model_len_stops_with_length(tiny, prompt_len):
    """A sequence stops with 'length' when prompt + output reaches max_model_len, well before its
    max_tokens; a prompt of exactly max_model_len still yields its one token."""
    m = tiny.max_model_len
    assert m == 64
    engine = new_engine(tiny, max_num_seqs=2)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    short = (prompt(random.Random(5), 4), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    s, other = run_sync(engine, [(prompt(random.Random(4), prompt_len), params), short])
    assert s.finish_reason == "length"
    assert len(s.output_ids) == max(1, m - prompt_len)
    assert other.output_ids == run_alone(tiny, *short)[0]  # its batch mate is unaffected


def test_stop_token_ids_stop_without_emitting(tiny):
    """A token in stop_token_ids ends the request with 'stop' and is not part of the output."""
    p = prompt(random.Random(6), 8)
    free, _ = run_alone(tiny, p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    ids, reason = run_alone(tiny, p, SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(free[k],)))
    assert reason == "stop"
    assert ids == free[:k]


def _find_eos_prompt(tiny) -> tuple[list[int], SamplingParams]:
    """A (prompt, seeded params) whose run draws EOS early."""
    rng = random.Random(7)
    for i in range(300):
        params = SamplingParams(max_tokens=30, temperature=1.0, seed=i)
        p = prompt(rng, rng.randint(2, 10))
        if run_alone(tiny, p, params)[1] == "stop":
            return p, params
    pytest.fail("no prompt of the tiny model draws EOS")


def test_eos_stops_unless_ignored(tiny):
    """Drawing EOS ends the request with 'stop' and EOS is not emitted; with ignore_eos the same
    draw is emitted and generation continues."""
    p, params = _find_eos_prompt(tiny)
    ids, reason = run_alone(tiny, p, params)
    assert reason == "stop" and not set(ids) & set(tiny.eos_token_ids)
    more, reason = run_alone(tiny, p, SamplingParams(**{**params.__dict__, "ignore_eos": True}))
    assert reason == "length" and len(more) == params.max_tokens
    assert more[: len(ids)] == ids and more[len(ids)] in tiny.eos_token_ids


def test_generation_config_eos_stops(tiny, tmp_path):
    """A token that only the checkpoint's generation_config.json names as end of sequence (a chat
    model's end of turn) ends generation as the config's own EOS does, and is not emitted."""
    p = prompt(random.Random(6), 8)
    free, _ = run_alone(tiny, p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i] and free[i] not in tiny.eos_token_ids)
    model_dir = shutil.copytree(tiny.model_dir, tmp_path / "model")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[k], tiny.eos_token_ids[0]]}))
    config = EngineConfig(model=str(model_dir), max_model_len=tiny.max_model_len, device="cpu")
    engine, _ = LLMEngine.from_config(config)
    assert set(engine.eos_token_ids) == {free[k], *tiny.eos_token_ids}
    seq = engine.add_request(p, SamplingParams(max_tokens=30, temperature=0.0))
    while engine.has_work():
        engine.step()
    assert (seq.output_ids, seq.finish_reason) == (free[:k], "stop")


def test_max_model_len_beyond_the_model_is_capped_and_said(tiny, caplog):
    """A max_model_len above the checkpoint's max_position_embeddings serves that many positions,
    and the log says so (clients see it in /v1/models and in the 400s)."""
    trained = json.loads((tiny.model_dir / "config.json").read_text())["max_position_embeddings"]
    config = EngineConfig(model=str(tiny.model_dir), max_model_len=trained + 1000, max_num_seqs=1, device="cpu")
    with caplog.at_level("WARNING", logger="workers.serving.engine"):
        engine, _ = LLMEngine.from_config(config)
    assert engine.max_model_len == trained
    assert f"max_model_len={trained + 1000} is more than" in caplog.text and f"max_model_len={trained}" in caplog.text


def test_a_max_model_len_of_one_position_is_refused_saying_why(tiny):
    """One position (a config's, or a checkpoint trained for one) failed in the warm-up with an
    IndexError from the rope table."""
    config = EngineConfig(model=str(tiny.model_dir), max_model_len=1, max_num_seqs=1, device="cpu")
    with pytest.raises(ValueError, match="a sequence needs at least 2 positions"):
        LLMEngine.from_config(config)


def _stop_string_case(tiny) -> tuple[list[int], list[int], str, int]:
    """A prompt whose greedy text has a clean two-character substring first occurring a few
    characters in: (prompt, greedy ids, stop string, its index in the text)."""
    rng = random.Random(8)
    for _ in range(50):
        p = prompt(rng, 5)
        ids, _ = run_alone(tiny, p, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        text = tiny.tokenizer.decode(ids, skip_special_tokens=True)
        for i in range(3, 12):
            stop = text[i : i + 2]
            if stop.isprintable() and "\ufffd" not in stop and len(stop) == 2 and text.find(stop) == i:
                return p, ids, stop, i
    pytest.fail("no usable stop string in the greedy outputs")


async def test_stop_string_cuts_text_and_frees_slot(tiny, start, monkeypatch):
    """A stop string taken from the greedy output cuts the streamed text right before it, ends the
    stream with 'stop', and the request ends in the engine as 'stop' too (slot freed) long before
    its max_tokens."""
    p, ids, stop, i = _stop_string_case(tiny)
    text = tiny.tokenizer.decode(ids, skip_special_tokens=True)
    engine = new_engine(tiny, max_num_seqs=2)
    slow_steps(monkeypatch, engine)
    runner = start(engine)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, stop=(stop,))
    r = await asyncio.wait_for(collect(runner.submit(p, params)), 30)
    assert r.reason == "stop"
    assert r.text == text[:i]
    assert r.ids == ids[: len(r.ids)] and len(r.ids) < 50
    await wait_until(lambda: all_slots_free(engine))
    assert engine.stats.snapshot()["finished_requests"] == {"stop": 1}


# ---------------------------------------------------------------- rejection


async def test_submit_rejects_bad_prompts_immediately(tiny, start):
    """A prompt longer than max_model_len (or empty) raises InvalidRequest from submit() itself,
    naming max_model_len; nothing is queued and the engine keeps serving."""
    engine = new_engine(tiny, max_num_seqs=2)
    runner = start(engine)
    with pytest.raises(InvalidRequest, match="max_model_len=64"):
        runner.submit(list(range(65)), SamplingParams())
    with pytest.raises(InvalidRequest):
        runner.submit([], SamplingParams())
    assert engine.scheduler.num_unfinished == 0
    r = await asyncio.wait_for(collect(runner.submit([BOS, 1, 2], SamplingParams(max_tokens=3, ignore_eos=True))), 30)
    assert r.reason == "length" and len(r.ids) == 3


async def test_submit_rejects_out_of_vocab_prompt(tiny, start):
    """A prompt id outside the vocabulary is an InvalidRequest at submit(), not an IndexError in the
    step that kills the engine for every request; the sync add_request rejects it too."""
    engine = new_engine(tiny, max_num_seqs=2)
    runner = start(engine)
    vocab = tiny.model.cfg.vocab_size
    for bad in ([BOS, vocab], [BOS, -1]):
        with pytest.raises(InvalidRequest, match="token ids"):
            runner.submit(bad, SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequest):
            new_engine(tiny, max_num_seqs=1).add_request(bad, SamplingParams(max_tokens=2))
    r = await asyncio.wait_for(collect(runner.submit([BOS, vocab - 1], SamplingParams(max_tokens=2))), 30)
    assert r.reason in ("length", "stop") and runner.alive


async def test_duplicate_request_id_rejected(tiny, start, monkeypatch):
    """submit() with the id of a request still in flight raises InvalidRequest; the first request is
    unaffected (its stream completes, its slot comes back) and the id is reusable afterwards."""
    engine = new_engine(tiny, max_num_seqs=2)
    slow_steps(monkeypatch, engine, 0.005)
    runner = start(engine)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = runner.submit([BOS, 1, 2], params, request_id="req-1")
    with pytest.raises(InvalidRequest, match="req-1"):
        runner.submit([BOS, 3, 4], params, request_id="req-1")
    r = await asyncio.wait_for(collect(first), 30)
    assert (r.ids, r.reason) == run_alone(tiny, [BOS, 1, 2], params)
    await wait_until(lambda: all_slots_free(engine))
    again = await asyncio.wait_for(collect(runner.submit([BOS, 3, 4], params, request_id="req-1")), 30)
    assert again.reason == "length" and len(again.ids) == 6


def test_a_refused_add_under_a_running_requests_id_leaves_that_request_running(tiny):
    """The step loop ends what a failed command left queued: an Add refused because its id is in
    use (the front refuses it first; a caller past the front does not) aborted the request that
    holds the id."""
    engine = new_engine(tiny, max_num_seqs=2)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine.add_request([BOS, 1, 2], params, request_id="req-1")
    engine.step()
    (event,) = apply_contained(engine, Add(new_sequence([BOS, 3, 4], params, "req-1")))
    assert event.finish_reason == "error" and "already in use" in str(event.error)
    while engine.has_work():
        engine.step()
    assert (first.output_ids, first.finish_reason) == run_alone(tiny, [BOS, 1, 2], params)


async def test_queue_full_over_capacity(tiny, start):
    """Once max_num_seqs + max_waiting requests are in flight, submit() raises QueueFull; when they
    finish there is room again."""
    engine = new_engine(tiny, max_num_seqs=2, max_waiting=2)
    runner = start(engine)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    streams = [runner.submit([BOS, i + 1], params) for i in range(4)]
    with pytest.raises(QueueFull):
        runner.submit([BOS, 9], params)
    results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 30)
    assert all(r.reason == "length" for r in results)
    r = await asyncio.wait_for(collect(runner.submit([BOS, 9], params)), 30)
    assert len(r.ids) == 4


def test_sync_abort_running_and_waiting(tiny):
    """LLMEngine.abort ends a running or a waiting request ('abort'), frees the slot, and the other
    requests still finish with their solo tokens; unknown ids answer False."""
    engine = new_engine(tiny, max_num_seqs=1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reqs = [(prompt(random.Random(9 + i), 5), params) for i in range(3)]
    a, b, c = (engine.add_request(p, s) for p, s in reqs)
    engine.step()
    assert a.slot == 0 and len(a.output_ids) > 0
    assert engine.abort(b.request_id)  # waiting
    assert engine.abort(a.request_id)  # running
    assert not engine.abort(a.request_id) and not engine.abort("nope")
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort")
    while engine.has_work():
        engine.step()
    assert c.output_ids == run_alone(tiny, *reqs[2])[0] and engine.scheduler.free_slots == [0]
    assert engine.stats.snapshot()["finished_requests"] == {"abort": 2, "length": 1}


# ---------------------------------------------------------------- cancellation


async def test_closing_stream_early_frees_slot(tiny, start, monkeypatch):
    """Breaking out of a stream and closing it aborts the request in the engine: its slot comes back
    while it still had tokens to go, and the other requests complete with their solo tokens."""
    engine = new_engine(tiny, max_num_seqs=3)
    slow_steps(monkeypatch, engine)
    runner = start(engine)
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    others = [(prompt(random.Random(20 + i), 6), SamplingParams(max_tokens=10, temperature=0.0)) for i in range(2)]
    tasks = [asyncio.create_task(collect(runner.submit(p, s))) for p, s in others]
    stream = runner.submit(prompt(random.Random(10), 6), long)
    got = 0
    async for ev in stream:
        got += len(ev.token_ids)
        if got:
            break
    await stream.aclose()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    for (p, s), r in zip(others, results):
        assert (r.ids, r.reason) == run_alone(tiny, p, s)
    await wait_until(lambda: all_slots_free(engine))
    snap = engine.stats.snapshot()
    assert snap["finished_requests"].get("abort") == 1
    assert snap["generated_tokens"] < 50 + 20


async def test_cancelling_consumer_task_frees_slot(tiny, start, monkeypatch):
    """Cancelling the task that consumes a stream (a client gone) aborts its request in the engine."""
    engine = new_engine(tiny, max_num_seqs=2)
    slow_steps(monkeypatch, engine)
    runner = start(engine)
    first = asyncio.Event()
    task = asyncio.create_task(
        collect(runner.submit([BOS, 5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True)), first)
    )
    await asyncio.wait_for(first.wait(), 10)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await wait_until(lambda: all_slots_free(engine) and not engine.has_work())
    assert engine.stats.snapshot()["finished_requests"] == {"abort": 1}
    # the engine is still fine: a new request completes
    r = await asyncio.wait_for(collect(runner.submit([BOS, 1], SamplingParams(max_tokens=2, ignore_eos=True))), 30)
    assert r.reason == "length"


async def test_cancelling_waiting_request(tiny, start, monkeypatch):
    """A request cancelled while still queued (all slots busy) is dropped from the queue; the running
    one is untouched."""
    engine = new_engine(tiny, max_num_seqs=1)
    slow_steps(monkeypatch, engine)
    runner = start(engine)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    first_prompt = [BOS, 3, 4]
    running = asyncio.create_task(collect(runner.submit(first_prompt, params)))
    waiting = asyncio.create_task(collect(runner.submit([BOS, 8, 9], params)))
    await wait_until(lambda: len(engine.scheduler.waiting) == 1)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    await wait_until(lambda: not engine.scheduler.waiting)
    r = await asyncio.wait_for(running, 30)
    assert (r.ids, r.reason) == run_alone(tiny, first_prompt, params)
    assert engine.stats.snapshot()["finished_requests"] == {"length": 1, "abort": 1}


async def test_mixed_cancel_break_and_stop_leak_nothing(tiny, start):
    """A burst of requests that finish, hit stop strings, are abandoned after one event or cancelled
    at random moments leaves nothing behind: every slot free, nothing queued or in flight, engine
    alive and still serving."""
    engine = new_engine(tiny, max_num_seqs=4)
    runner = start(engine)
    rng = random.Random(12)

    async def client(i: int) -> None:
        p = prompt(rng, rng.randint(2, 20))
        params = SamplingParams(
            max_tokens=rng.randint(1, 30),
            temperature=rng.choice([0.0, 1.0]),
            seed=i,
            stop=rng.choice([(), ("a",), ("\x00", "e")]),
        )
        stream = runner.submit(p, params)
        mode = i % 3
        if mode == 0:
            await collect(stream)
        elif mode == 1:
            async for _ in stream:
                break
            await stream.aclose()
        else:
            task = asyncio.create_task(collect(stream))
            await asyncio.sleep(rng.random() * 0.01)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(40))), 30)
    await wait_until(lambda: not engine.has_work() and all_slots_free(engine))
    assert runner.alive and not runner._streams and runner._inflight == 0
    assert sum(engine.stats.snapshot()["finished_requests"].values()) == 40
    r = await asyncio.wait_for(collect(runner.submit([BOS, 1], SamplingParams(max_tokens=2, ignore_eos=True))), 30)
    assert r.reason == "length"


# ---------------------------------------------------------------- failure


async def test_engine_loop_failure_fails_streams_and_submit(tiny, start, monkeypatch):
    """If a step raises, every open stream gets EngineDeadError, alive turns False, and submit()
    refuses new work with EngineDeadError instead of hanging."""
    engine = new_engine(tiny, max_num_seqs=2)
    all_submitted = threading.Event()

    def failing_step(first_tokens=None):
        all_submitted.wait(5)  # fail only once every request is in, so each has a stream to fail
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", failing_step)
    runner = start(engine)
    assert runner.alive
    params = SamplingParams(max_tokens=5)
    streams = [runner.submit([BOS, i + 1], params) for i in range(3)]
    all_submitted.set()
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(collect(s) for s in streams), return_exceptions=True), timeout=10
    )
    assert all(isinstance(o, EngineDeadError) for o in outcomes), outcomes
    assert "boom" in str(outcomes[0])
    await wait_until(lambda: not runner.alive)
    assert isinstance(runner.error, RuntimeError)
    with pytest.raises(EngineDeadError):
        runner.submit([BOS, 1], params)


async def test_shutdown_fails_open_streams(tiny, start, monkeypatch):
    """Shutting the engine down while a stream is open ends that stream with EngineDeadError instead
    of leaving its consumer waiting forever; later submits are refused."""
    engine = new_engine(tiny, max_num_seqs=2)
    slow_steps(monkeypatch, engine)
    runner = start(engine)
    first = asyncio.Event()
    task = asyncio.create_task(
        collect(runner.submit([BOS, 1, 2], SamplingParams(max_tokens=50, ignore_eos=True)), first)
    )
    await asyncio.wait_for(first.wait(), 10)
    runner.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(task, 5)
    assert not runner.alive
    with pytest.raises(EngineDeadError):
        runner.submit([BOS, 1], SamplingParams())


# ---------------------------------------------------------------- stats


async def test_stats_snapshot_matches_streams(tiny, start):
    """Stats agree with what the streams delivered: one TTFT per request with a token, one TPOT per
    request with two or more, generated tokens = tokens emitted, prompt tokens summed, finish
    reasons counted, and decode batch sizes account for every decode step."""
    engine = new_engine(tiny, max_num_seqs=3)
    runner = start(engine)
    rng = random.Random(11)
    requests = [
        (prompt(rng, rng.randint(2, 12)), SamplingParams(max_tokens=n, ignore_eos=True)) for n in (1, 2, 5, 9, 13)
    ]
    results = await asyncio.wait_for(asyncio.gather(*(collect(runner.submit(p, s)) for p, s in requests)), 30)
    snap = engine.stats.snapshot()
    assert snap["ttft_s"]["count"] == 5
    assert snap["tpot_s"]["count"] == 4  # the max_tokens=1 request has no time per output token
    assert snap["ttft_s"]["mean"] > 0 and snap["tpot_s"]["p99"] >= snap["tpot_s"]["p50"] > 0
    assert snap["generated_tokens"] == sum(len(r.ids) for r in results) == 1 + 2 + 5 + 9 + 13
    assert snap["prompt_tokens"] == sum(len(p) for p, _ in requests)
    assert snap["finished_requests"] == {"length": 5}
    assert sum(snap["decode_batch_sizes"].values()) == snap["decode_steps"]
    assert sum(n * c for n, c in snap["decode_batch_sizes"].items()) + 5 == snap["generated_tokens"]
    assert max(snap["decode_batch_sizes"]) <= 3
    assert snap["busy_s"]["prefill"] > 0 and snap["busy_s"]["decode"] > 0


# ---------------------------------------------------------------- paging and preemption


def test_preemption_loses_nothing_and_sends_nothing_twice(tiny):
    """A KV pool of 10 pages of 8 tokens for 6 slots: sequences outgrow it, the newest are preempted
    and prefilled again later with their output so far. Every request still ends with exactly the
    tokens it produces alone, each token reported once, in order; every page comes back."""
    requests = mixed_requests(3, 16, temperature=0.0, ignore_eos=True)
    engine = new_engine(tiny, max_num_seqs=6, kv_page_size=8, kv_cache_tokens=80)
    assert engine.cache.num_pages == 1 + 10
    seqs = [engine.add_request(p, params) for p, params in requests]
    reported = {s.request_id: [] for s in seqs}
    while engine.has_work():
        for event in engine.step():
            reported[event.request_id] += event.token_ids
    for (p, params), s in zip(requests, seqs):
        assert (s.output_ids, s.finish_reason) == run_alone(tiny, p, params)
        assert reported[s.request_id] == s.output_ids
    status = engine.status()
    assert status.kv_cache.preemptions > 0
    assert status.kv_cache.pages_free == status.kv_cache.pages == 10
    assert all_slots_free(engine)


def test_sampled_requests_resume_the_same_after_preemption(tiny):
    """A seeded sampled request draws the same tokens whether or not it was preempted on the way:
    re-prefill samples its next token at the same step of its seed."""
    rng = random.Random(4)
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    requests = [(prompt(rng, 20), params) for _ in range(4)]
    engine = new_engine(tiny, max_num_seqs=4, kv_page_size=8, kv_cache_tokens=96)
    seqs = run_sync(engine, requests)
    assert engine.status().kv_cache.preemptions > 0
    for (p, sp), s in zip(requests, seqs):
        assert s.output_ids == run_alone(tiny, p, sp)[0]


def test_a_pool_that_cannot_hold_max_model_len_is_refused_naming_the_keys(tiny):
    with pytest.raises(ValueError, match=f"kv_cache_tokens={tiny.max_model_len - 8} cannot hold one sequence"):
        new_engine(tiny, kv_page_size=8, kv_cache_tokens=tiny.max_model_len - 8)
    with pytest.raises(ValueError, match="kv_cache_tokens=1 cannot hold one sequence of max_model_len"):
        new_engine(tiny, kv_page_size=64, kv_cache_tokens=1)  # one page would hold 64 tokens: still refused
    for page_size in (0, -4):  # was a ZeroDivisionError, or torch's "negative dimension"
        with pytest.raises(ValueError, match=f"kv_page_size={page_size}: a KV page holds at least one"):
            new_engine(tiny, kv_page_size=page_size)


def test_rollout_cohorts_are_counted_apart(tiny):
    """Rows allowed graphs (the rollout's graph cohort: here on CPU they fall back, `unavailable`)
    and rows held back are counted apart, and each cohort's model calls are timed at their batch
    size; tenant-disabled rows are in neither cohort's rows."""
    engine = new_engine(tiny, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    denials = [None, None, FallbackReason.ROLLOUT_HOLDBACK, FallbackReason.TENANT_DISABLED]
    for i, denial in enumerate(denials):
        engine.add_request(prompt(random.Random(40 + i), 5), params, graph_denial=denial)
    while engine.has_work():
        engine.step()
    cohorts = engine.stats.snapshot()["cohorts"]
    steps = 5  # 6 tokens: one from the prefill, five decode steps
    assert cohorts["graph"]["rows"] == 2 * steps and cohorts["graph"]["fallback_rows"] == 2 * steps
    assert cohorts["holdback"]["rows"] == steps and cohorts["holdback"]["fallback_rows"] == 0
    graph_calls, seconds = cohorts["graph"]["calls"][2]
    assert graph_calls == steps and seconds > 0
    assert cohorts["holdback"]["calls"][2][0] == steps  # the eager call of the held-back and disabled rows


# ---------------------------------------------------------------- penalties, logit_bias, logprobs


def penalized_requests(seed: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded sampled requests with strong penalties (and some with a logit_bias)."""
    rng = random.Random(seed)
    return [
        (
            prompt(rng, rng.randint(2, 20)),
            SamplingParams(
                max_tokens=rng.randint(10, 30),
                temperature=rng.choice([0.0, 0.9]),
                seed=i,
                ignore_eos=True,
                presence_penalty=1.5,
                frequency_penalty=0.5,
                repetition_penalty=2.0,
                logit_bias=((rng.randrange(256), 5.0),) if i % 2 else (),
            ),
        )
        for i in range(n)
    ]


def test_penalized_requests_batched_and_preempted_match_solo_runs(tiny):
    """Requests with penalties through 6 slots and a pool too small for all of them (slots reused,
    newest preempted and prefilled again): each ends with exactly the tokens it produces alone, so
    its history followed it and never mixed with a slot's previous owner's. The penalties really
    changed what was generated."""
    requests = penalized_requests(9, 16)
    engine = new_engine(tiny, max_num_seqs=6, kv_page_size=8, kv_cache_tokens=120)
    seqs = run_sync(engine, requests)
    assert engine.status().kv_cache.preemptions > 0
    for (p, params), s in zip(requests, seqs):
        assert (s.output_ids, s.finish_reason) == run_alone(tiny, p, params)
    plain = [
        run_alone(
            tiny,
            p,
            SamplingParams(
                max_tokens=params.max_tokens, temperature=params.temperature, seed=params.seed, ignore_eos=True
            ),
        )[0]
        for p, params in requests
    ]
    assert sum(s.output_ids != ids for s, ids in zip(seqs, plain)) >= 12
    greedy_plain = [ids for ids, (_, params) in zip(plain, requests) if params.greedy]
    greedy = [s.output_ids for s, (_, params) in zip(seqs, requests) if params.greedy]
    # the repetition penalty makes the greedy text repeat itself less
    assert sum(len(set(ids)) for ids in greedy) > sum(len(set(ids)) for ids in greedy_plain)


def test_logprobs_are_log_softmax_of_the_engine_logits(tiny, monkeypatch):
    """Each token's reported logprob is log_softmax of the logits the engine sampled it from (with
    its penalties and bias applied), its alternatives are the top-k of that distribution, best
    first; a request that did not ask gets none, and one per token is reported for those that did."""
    engine = new_engine(tiny, max_num_seqs=3)
    seen: dict[str, list[torch.Tensor]] = {}
    draw = engine.sampler.draw

    def spy(logits, seqs):
        for row, seq in zip(logits, seqs):
            seen.setdefault(seq.request_id, []).append(row.float().clone())
        return draw(logits, seqs)

    monkeypatch.setattr(engine.sampler, "draw", spy)
    rng = random.Random(10)
    asked = [
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=4, ignore_eos=True),
        SamplingParams(
            max_tokens=8,
            temperature=1.0,
            seed=3,
            logprobs=0,
            ignore_eos=True,
            logit_bias=((65, 3.0),),
            frequency_penalty=1.0,
        ),
    ]
    seqs = [engine.add_request(prompt(rng, 6), params) for params in asked]
    quiet = engine.add_request(prompt(rng, 6), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    reported: dict[str, list] = {s.request_id: [] for s in [*seqs, quiet]}
    while engine.has_work():
        for event in engine.step():
            assert (event.logprobs is None) == (event.request_id == quiet.request_id)
            reported[event.request_id] += event.logprobs or []
    assert reported[quiet.request_id] == []
    for seq in seqs:
        lps = reported[seq.request_id]
        assert len(lps) == len(seq.output_ids) == 8
        for i, (token, lp) in enumerate(zip(seq.output_ids, lps)):
            raw = seen[seq.request_id][i]
            p = seq.params
            if p.penalized or p.logit_bias:  # what the sampler did to the logits, by the formulas
                history = torch.bincount(torch.tensor(seq.output_ids[:i], dtype=torch.int64), minlength=raw.numel())
                raw = raw - p.frequency_penalty * history
                for t, bias in p.logit_bias:
                    raw[t] += bias
            ref = raw.double().log_softmax(0)
            assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-4)
            assert [t for t, _ in lp.top] == ref.topk(p.logprobs).indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(ref.topk(p.logprobs).values.tolist(), abs=1e-4)
    assert seqs[0].output_ids == [int(r.argmax()) for r in seen[seqs[0].request_id]]


async def test_streamed_logprobs_follow_the_tokens_returned(tiny, start, monkeypatch):
    """Streamed logprobs come one per token returned, merged across steps; a stop string that cuts
    the tokens cuts their logprobs with them."""
    p, ids, stop, _ = _stop_string_case(tiny)
    engine = new_engine(tiny, max_num_seqs=2)
    slow_steps(monkeypatch, engine, 0.005)
    runner = start(engine)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, logprobs=2)
    whole = []
    async for event in runner.submit(p, params, coalescing=Coalescing(0.02)):
        assert len(event.logprobs) == len(event.token_ids)
        whole += event.logprobs
    assert len(whole) == 50
    cut_ids, cut = [], []
    async for event in runner.submit(p, SamplingParams(**{**params.__dict__, "stop": (stop,)})):
        assert len(event.logprobs) == len(event.token_ids)
        cut_ids += event.token_ids
        cut += event.logprobs
    assert 0 < len(cut_ids) < 50 and cut == whole[: len(cut_ids)]


async def test_submit_rejects_logit_bias_outside_the_vocabulary(tiny, start):
    runner = start(new_engine(tiny, max_num_seqs=1))
    vocab = tiny.model.cfg.vocab_size
    with pytest.raises(InvalidRequest, match="logit_bias"):
        runner.submit([BOS, 1], SamplingParams(logit_bias=((vocab, 1.0),)))
    r = await asyncio.wait_for(
        collect(runner.submit([BOS, 1], SamplingParams(max_tokens=2, logit_bias=((vocab - 1, 1.0),)))), 30
    )
    assert r.completion_tokens >= 1
