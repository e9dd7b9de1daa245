"""Prompts arriving while others decode are gathered into one prefill (`policies/prefill_waves.py`):
the rule alone, then the scheduler applying it, with the clock given."""

from __future__ import annotations

import pytest

from policies.kv_blocks import BlockManager
from policies.prefill_waves import wave_due
from workers.modeling.default_model import default_model_dir
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams
from workers.serving.scheduler import Scheduler, Sequence, new_sequence

DELAY = 0.010


@pytest.mark.parametrize(
    ("decoding", "prefilling", "waited", "tokens", "budget", "delay", "due"),
    [
        (0, False, 0.0, 10, 1000, DELAY, True),  # nothing decodes: a prefill stalls no one
        (8, True, 0.0, 10, 1000, DELAY, True),  # a chunk is prefilled this step anyway
        (8, False, 0.0, 10, 1000, DELAY, False),  # just arrived, few tokens: wait for more
        (8, False, 0.009, 10, 1000, DELAY, False),
        (8, False, 0.010, 10, 1000, DELAY, True),  # waited the delay
        (8, False, 0.0, 1000, 1000, DELAY, True),  # the waiting prompts fill the budget
        (8, False, 0.0, 10, 1000, 0.0, True),  # no delay: never wait
    ],
)
def test_the_rule(decoding, prefilling, waited, tokens, budget, delay, due):
    assert wave_due(decoding, prefilling, waited, tokens, budget, delay) is due


def seq(request_id: str, n: int, at: float, first: int = 1) -> Sequence:
    s = new_sequence(list(range(first, first + n)), SamplingParams(max_tokens=64), request_id)
    s.arrival_time = at
    return s


def scheduler(delay: float, budget: int = 1000) -> Scheduler:
    return Scheduler(8, 256, 16, budget, blocks=BlockManager(1 + 8 * 64, 4), max_prefill_delay_s=delay)


def decoding(s: Scheduler, now: float) -> None:
    """One running sequence, past its prefill."""
    s.add(seq("running", 8, now))
    assert [q.request_id for q in s.admit(now=now)] == ["running"]
    s.reserve_decode()


def test_arrivals_while_a_batch_decodes_wait_and_go_in_one_prefill():
    s = scheduler(DELAY)
    decoding(s, 100.0)
    s.add(seq("a", 5, 100.001, first=20))
    assert s.admit(now=100.002) == [] and s.chunks == []  # held back: the running sequence decodes alone
    s.reserve_decode()
    s.add(seq("b", 5, 100.006, first=40))
    assert s.admit(now=100.008) == []
    s.reserve_decode()
    admitted = s.admit(now=100.012)  # a has waited the delay: both go, in one prefill
    assert [q.request_id for q in admitted] == ["a", "b"]
    assert [q.request_id for q in s.chunks] == ["a", "b"]


def test_without_a_delay_each_arrival_is_prefilled_in_the_next_step():
    s = scheduler(0.0)
    decoding(s, 100.0)
    s.add(seq("a", 5, 100.001, first=20))
    assert [q.request_id for q in s.admit(now=100.002)] == ["a"]


def test_nothing_waits_when_nothing_decodes():
    s = scheduler(DELAY)
    s.add(seq("a", 5, 100.0))
    assert [q.request_id for q in s.admit(now=100.0)] == ["a"]


def test_a_full_budget_goes_at_once():
    s = scheduler(DELAY, budget=16)
    decoding(s, 100.0)
    s.add(seq("a", 8, 100.001, first=20))
    assert s.admit(now=100.001) == []
    s.reserve_decode()
    s.add(seq("b", 8, 100.002, first=40))  # 16 tokens wait: a step's budget (less the one decode) is full
    assert [q.request_id for q in s.admit(now=100.002)] == ["a", "b"]


def test_newcomers_ride_with_a_chunk_under_way():
    blocks = BlockManager(1 + 8 * 64, 4)
    s = Scheduler(8, 256, 16, 64, blocks=blocks, long_prefill_token_threshold=8, max_prefill_delay_s=DELAY)
    decoding(s, 100.0)
    s.add(seq("long", 30, 100.0, first=20))
    assert [q.request_id for q in s.admit(now=100.0 + DELAY)] == ["long"]  # its first chunk
    s.reserve_decode()
    s.add(seq("a", 3, 100.011, first=60))
    admitted = s.admit(now=100.011)  # long's next chunk is prefilled now: a goes with it
    assert [q.request_id for q in s.chunks][0] == "long" and [q.request_id for q in admitted] == ["a"]


def test_a_negative_delay_is_refused():
    with pytest.raises(ValueError, match="max_prefill_delay_s"):
        scheduler(-1.0)


def drive(delay_ms: float) -> tuple[list[list[int]], int]:
    """A request decoding, two more arriving one step apart: every request's tokens and the
    engine's prefill calls."""
    engine, _ = LLMEngine.from_config(
        EngineConfig(
            model=str(default_model_dir()),
            max_num_seqs=4,
            max_model_len=64,
            device="cpu",
            max_prefill_delay_ms=delay_ms,
        )
    )
    params = SamplingParams(max_tokens=6, temperature=0.0)
    seqs = [engine.add_request([5, 6, 7, 8, 9], params)]
    for prompt in ([11, 12, 13], [21, 22, 23, 24]):
        engine.step()
        seqs.append(engine.add_request(prompt, params))
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs], engine.stats.prefill_steps


def test_the_engine_gathers_arrivals_into_one_prefill_and_decodes_the_same_tokens(tmp_path, monkeypatch):
    """Held back until the first request ends (a delay no step reaches), the two later arrivals
    are prefilled in one call, and every request decodes what it decodes prefilled on arrival."""
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    at_once, calls_at_once = drive(0.0)
    gathered, calls_gathered = drive(1e6)
    assert gathered == at_once and all(len(tokens) == 6 for tokens in gathered)
    assert (calls_at_once, calls_gathered) == (3, 2)
