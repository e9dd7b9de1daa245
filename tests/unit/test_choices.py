"""What the replica does for a request of n choices: their seeds, their fit in the KV pool, the
merge of their streams (a consumer that leaves ends every choice), and logprobs' token strings."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from app.replica import _merged, choice_sampling, fit_choices, logprob_items
from tests.unit.engine_fixtures import Tiny, load_tiny
from workers.protocol import StreamEvent
from workers.serving.outputs import KvCacheStatus
from workers.serving.sampling import InvalidRequest, SamplingParams, TokenLogprob, choice_seed

KV = KvCacheStatus(page_size=16, pages=64, pages_free=64, pages_cached=0, max_num_seqs=64, preemptions=0)  # 1024 tokens
MAX_WAITING = 0  # with KV's 64 slots: none of these requests asks for more sequences
HOLDS_3 = dataclasses.replace(KV, max_num_seqs=2)  # and max_waiting=1: 3 sequences at once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def test_choice_sampling_seeds():
    """Choice 0 keeps the request's fields as they are; the others get derived seeds (an unseeded
    request of n > 1 is seeded before its choices are made: `_generate`)."""
    sampling = SamplingParams(seed=42, temperature=0.7)
    assert choice_sampling(sampling, 0) is sampling
    assert choice_sampling(sampling, 3) == SamplingParams(seed=choice_seed(42, 3), temperature=0.7)


def test_choices_must_fit_the_kv_pool_side_by_side():
    assert fit_choices(1, 1000, True, 24, KV, MAX_WAITING) == 1000
    assert fit_choices(4, 200, True, 50, KV, MAX_WAITING) == 200  # 4 x 250 <= 1024
    with pytest.raises(InvalidRequest, match="n=4") as info:
        fit_choices(4, 300, True, 50, KV, MAX_WAITING)
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequest, match="max_completion_tokens=300") as info:
        fit_choices(4, 300, True, 50, KV, MAX_WAITING, "max_completion_tokens")
    assert info.value.param == "max_completion_tokens"
    assert fit_choices(4, 900, False, 50, KV, MAX_WAITING) == 206  # a default shrinks: 1024 // 4 - 50
    with pytest.raises(InvalidRequest, match="KV cache"):
        fit_choices(16, 10, False, 64, KV, MAX_WAITING)  # no room at all for a choice


def test_more_choices_than_the_engine_holds_are_refused_naming_n():
    assert fit_choices(3, 10, True, 5, HOLDS_3, max_waiting=1) == 10
    with pytest.raises(InvalidRequest, match="n=4 choices run as 4 sequences") as info:
        fit_choices(4, 10, True, 5, HOLDS_3, max_waiting=1)
    assert info.value.param == "n"


def event(text: str, reason: str | None = None) -> StreamEvent:
    return StreamEvent("r", [1], text, 3, 1, reason)


class Stream:
    """A choice's stream: `items` with a pause before each; records whether it was closed early."""

    def __init__(self, items: list[StreamEvent], pause: float) -> None:
        self.items, self.pause, self.closed_early = items, pause, False

    async def run(self):
        try:
            for item in self.items:
                await asyncio.sleep(self.pause)
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            self.closed_early = True
            raise


async def test_merged_streams_keep_each_choice_in_order_and_interleave():
    fast = Stream([event("a1"), event("a2", "length")], 0.001)
    slow = Stream([event("b1"), event("b2"), event("b3", "stop")], 0.03)
    out = [(i, e.text) async for i, e in _merged([(event("a0"), fast.run()), (event("b0"), slow.run())])]
    assert [t for i, t in out if i == 0] == ["a0", "a1", "a2"]
    assert [t for i, t in out if i == 1] == ["b0", "b1", "b2", "b3"]
    assert out.index((0, "a2")) < out.index((1, "b1"))  # as they came, not one choice after the other
    single = [(i, e.text) async for i, e in _merged([(event("x"), Stream([event("y", "stop")], 0).run())])]
    assert single == [(0, "x"), (0, "y")]


async def test_leaving_a_merged_stream_ends_every_choice():
    """Closed early (its client left), the merge stops reading every choice, whose streams can
    then be closed as the replica does (none is still being read by a task of the merge)."""
    streams = [Stream([event(f"{i}-{k}") for k in range(100)], 0.01) for i in range(3)]
    runs = [s.run() for s in streams]
    merged = _merged([(event("first"), run) for run in runs])
    seen = [await anext(merged) for _ in range(6)]
    assert {i for i, _ in seen} == {0, 1, 2}
    await merged.aclose()
    for run in runs:
        await run.aclose()
    assert all(s.closed_early for s in streams)


async def test_a_failing_choice_fails_the_merge_and_ends_the_others():
    class Boom(RuntimeError):
        pass

    async def failing():
        await asyncio.sleep(0.01)
        raise Boom
        yield  # an async generator, as a stream is

    other = Stream([event(str(k)) for k in range(100)], 0.005)
    run = other.run()
    with pytest.raises(Boom):
        async for _ in _merged([(event("a"), failing()), (event("b"), run)]):
            pass
    await run.aclose()  # what the replica does with every choice's stream at the end
    assert other.closed_early


def test_logprob_items_carry_each_tokens_own_bytes(tiny):
    """Each token as the bytes it stands for (a piece of a multi-byte character is that piece, not
    U+FFFD), alternatives in their order."""
    tok = tiny.tokenizer
    ids = tok("é!")["input_ids"][1:]  # the byte-level tiny tokenizer: é is two tokens
    assert len(ids) == 3
    logprobs = [TokenLogprob(-0.1 * (k + 1), [(ids[k], -0.1 * (k + 1)), (ord("a"), -3.0)]) for k in range(3)]
    items = logprob_items(tok, StreamEvent("r", ids, "é!", 2, 3, None, logprobs))
    assert b"".join(i.token for i in items) == "é!".encode()
    assert items[2].token == b"!" and items[2].logprob == pytest.approx(-0.3)
    assert items[2].top == [(b"!", pytest.approx(-0.3)), (b"a", -3.0)]
    assert logprob_items(tok, StreamEvent("r", [], "", 2, 3, "stop", None)) == []
