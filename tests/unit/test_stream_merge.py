"""A stream's read gathers every event queued behind the first into one (`StreamFront._merge`)."""

from __future__ import annotations

import asyncio

import pytest

from workers.front.async_engine import StreamFront
from workers.protocol import TokenEvent
from workers.serving.sampling import TokenLogprob


def queued(*events) -> asyncio.Queue:
    q = asyncio.Queue()
    for e in events:
        q.put_nowait(e)
    return q


def lp(x: float) -> TokenLogprob:
    return TokenLogprob(x, [])


def test_queued_events_become_one_in_order_with_the_last_reason_and_the_latest_cached_count():
    q = queued(TokenEvent("r", [2, 3], cached_tokens=None), TokenEvent("r", [4], "length", cached_tokens=16))
    merged = StreamFront._merge(TokenEvent("r", [1], cached_tokens=0), q)
    assert (merged.token_ids, merged.finish_reason, merged.cached_tokens, merged.logprobs) == (
        [1, 2, 3, 4],
        "length",
        16,
        None,
    )
    assert q.empty()


def test_logprobs_are_kept_across_an_event_without_them():
    """An abort's event carries no logprobs where the request's others do."""
    q = queued(TokenEvent("r", [2], logprobs=[lp(-2.0)]), TokenEvent("r", [], "abort"))
    merged = StreamFront._merge(TokenEvent("r", [1], logprobs=[lp(-1.0)]), q)
    assert merged.logprobs == [lp(-1.0), lp(-2.0)] and merged.finish_reason == "abort"


def test_the_first_event_is_not_changed_and_a_finished_one_is_returned_as_it_is():
    first = TokenEvent("r", [1])
    merged = StreamFront._merge(first, queued(TokenEvent("r", [2])))
    assert first.token_ids == [1] and merged.token_ids == [1, 2]
    done = TokenEvent("r", [5], "stop")
    assert StreamFront._merge(done, queued(TokenEvent("r", [6]))) is done


def test_a_queued_failure_is_raised():
    with pytest.raises(RuntimeError, match="engine died"):
        StreamFront._merge(TokenEvent("r", [1]), queued(TokenEvent("r", [2]), RuntimeError("engine died")))
