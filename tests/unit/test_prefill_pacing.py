"""Pacing a long prompt's prefill (`policies/prefill_pacing.py`) on its own and in the scheduler's
plan: a prompt with more than `long_prefill_token_threshold` tokens left gets at most that many a
step, the prompts behind it get the rest of the budget in the same step, the budget is never
exceeded, tokens found in the prefix cache are not counted, and 0 plans what the scheduler planned
before the threshold existed (a prompt takes whatever the budget leaves)."""

from __future__ import annotations

import random

import pytest

from policies.kv_blocks import BlockManager
from policies.prefill_pacing import chunk_tokens
from workers.serving.sampling import SamplingParams
from workers.serving.scheduler import Scheduler, Sequence, new_sequence

PS = 4  # tokens per page in these tests


def prompt(request_id: str, n: int, tail_from: int = 1) -> Sequence:
    """n tokens: 1, 2, ... 16, then (from the 17th) counting on from tail_from + 16."""
    tokens = list(range(1, 17)) + list(range(tail_from + 16, tail_from + n))
    return new_sequence(tokens[:n], SamplingParams(max_tokens=4), request_id)


def scheduler(budget: int, threshold: int, prefix_caching: bool = False, max_num_seqs: int = 4) -> Scheduler:
    blocks = BlockManager(1 + max_num_seqs * 32, PS)
    return Scheduler(
        max_num_seqs,
        100,
        16,
        budget,
        blocks=blocks,
        prefix_caching=prefix_caching,
        long_prefill_token_threshold=threshold,
    )


def chunks(s: Scheduler) -> list[tuple[str, int, int]]:
    """This step's prefill chunks, as (request, start, end)."""
    return [(q.request_id, q.prefill_start, q.prefill_end) for q in s.chunks]


@pytest.mark.parametrize(
    ("left", "budget", "threshold", "chunk"),
    [
        (50, 1000, 0, 50),  # off: all of it when the budget holds it
        (50, 20, 0, 20),  # off: what the budget leaves
        (50, 1000, 8, 8),  # more than the threshold left: the threshold
        (8, 1000, 8, 8),  # exactly the threshold left: all of it
        (5, 1000, 8, 5),  # fewer left: all of it
        (50, 6, 8, 6),  # the budget left is smaller still
        (3, 2, 8, 2),
    ],
)
def test_a_chunk_is_the_smallest_of_what_is_left_the_budget_left_and_the_threshold(left, budget, threshold, chunk):
    assert chunk_tokens(left, budget, threshold) == chunk


def test_a_long_prompt_alone_goes_in_threshold_tokens_a_step():
    """50 tokens at most 8 a step, with a budget that would hold them all: ceil(50 / 8) = 7 steps,
    and it decodes only after the last."""
    s = scheduler(budget=1000, threshold=8)
    s.add(long := prompt("long", 50))
    plans = []
    while not plans or long.in_prefill:
        s.admit()
        plans.append(chunks(s))
        s.reserve_decode()
    assert plans == [[("long", start, min(start + 8, 50))] for start in range(0, 50, 8)]
    assert len(plans) == -(-50 // 8) and "long" in s.running


def test_a_short_prompt_behind_a_long_one_is_prefilled_in_the_same_step():
    """Unpaced, the long prompt takes the whole budget of 20 and the short one waits; paced at 8,
    the short one (and the next long one's first chunk) go in beside it."""
    unpaced = scheduler(budget=20, threshold=0)
    paced = scheduler(budget=20, threshold=8)
    for s in (unpaced, paced):
        for q in (prompt("long", 50), prompt("short", 5), prompt("long2", 30)):
            s.add(q)
    assert [q.request_id for q in unpaced.admit()] == ["long"] and chunks(unpaced) == [("long", 0, 20)]
    assert [q.request_id for q in paced.admit()] == ["long", "short", "long2"]
    assert chunks(paced) == [("long", 0, 8), ("short", 0, 5), ("long2", 0, 7)]
    assert not paced.running["short"].in_prefill  # it decodes this step
    paced.reserve_decode()
    # the next step: 20 less short's decode; both long prompts' chunks at most 8
    assert paced.admit() == [] and chunks(paced) == [("long", 8, 16), ("long2", 7, 15)]


def test_prefix_cache_hits_do_not_count_as_still_to_prefill():
    """A prompt whose first 16 of 22 tokens are cached has 6 left: under the threshold of 8, all of
    them go in one step; another of 26 tokens (the same 16 first, then its own) has 10 left, which
    go in as 8 and 2."""
    s = scheduler(budget=1000, threshold=8, prefix_caching=True)
    s.add(prompt("a", 16))
    s.admit()
    s.reserve_decode()
    s.admit()
    assert chunks(s) == [("a", 8, 16)]  # its 4 pages are cached as its chunks write them
    s.reserve_decode()
    s.add(b := prompt("b", 22))
    s.add(c := prompt("c", 26, tail_from=100))
    assert s.admit() == [b, c] and b.cached_tokens == c.cached_tokens == 16
    assert chunks(s) == [("b", 16, 22), ("c", 16, 24)]
    assert not b.in_prefill and c.in_prefill
    s.reserve_decode()
    s.admit()
    assert chunks(s) == [("c", 24, 26)]


def test_the_threshold_cuts_the_floor_of_a_page_a_step_too():
    """When decodes fill the budget a step still carries a page's worth of prompt; a threshold
    smaller than a page cuts that too (and the prompt still goes in, 2 tokens a step)."""
    s = scheduler(budget=4, threshold=2)
    for name in "abc":
        s.add(prompt(name, 1))
    s.admit()
    s.reserve_decode()  # three decode: 1 token of the budget left, raised to its floor of a page (4)
    s.add(prompt("late", 5))
    plans = []
    for _ in range(3):
        s.admit()
        plans.append(chunks(s))
        s.reserve_decode()
    assert plans == [[("late", 0, 2)], [("late", 2, 4)], [("late", 4, 5)]]


def drive(threshold: int, budget: int, seed: int) -> list[list[tuple[str, int, int, int]]]:
    """A random workload stepped as the engine steps it (admit, reserve, one token per decoding
    sequence, finish at 8 tokens), with page pressure (so preemptions) and shared prefixes. Checks
    every step's plan and returns the plans: per step, (request, start, end, length) per chunk."""
    rng = random.Random(seed)
    blocks = BlockManager(40, PS)
    s = Scheduler(6, 100, 64, budget, blocks=blocks, prefix_caching=True, long_prefill_token_threshold=threshold)
    shared = [rng.randrange(1, 50) for _ in range(40)]
    plans = []
    for n in range(300):
        for i in range(rng.choice([0, 0, 1, 2]) if s.num_unfinished < s.limits.capacity - 1 else 0):
            tokens = shared[: rng.randint(0, 40)] + [rng.randrange(1, 50) for _ in range(rng.choice([1, 5, 30, 50]))]
            s.add(new_sequence(tokens, SamplingParams(max_tokens=8), f"r{n}-{i}"))
        decoding = len(s.running) - len(s.prefilling)
        s.admit()
        plan = [(q.request_id, q.prefill_start, q.prefill_end, q.length) for q in s.chunks]
        check_plan(plan, max(budget - decoding, min(PS, budget)), threshold)
        plans.append(plan)
        s.reserve_decode()
        for q in [q for q in s.running.values() if not q.in_prefill]:
            q.output_ids.append(rng.randrange(1, 50))
            if len(q.output_ids) == q.params.max_tokens:
                s.finish(q, "length")
    assert s.num_preempted > 0 and sum(map(len, plans)) > 100
    return plans


def check_plan(plan: list[tuple[str, int, int, int]], budget: int, threshold: int) -> None:
    """The step's prompt tokens stay within its budget, and each chunk, in the order planned, is
    what the rule gives it from the budget the chunks before it left."""
    left = budget
    for _, start, end, length in plan:
        assert end - start == chunk_tokens(length - start, left, threshold) >= 1
        left -= end - start
    assert left >= 0
    if threshold:
        assert all(end - start <= threshold for _, start, end, _ in plan)


@pytest.mark.parametrize("budget", [7, 24, 64])
def test_random_workloads_keep_the_budget_and_the_threshold(budget):
    for threshold in (3, 8, 20):
        drive(threshold, budget, seed=budget + threshold)


@pytest.mark.parametrize("budget", [7, 24, 64])
def test_threshold_zero_plans_exactly_what_a_threshold_that_never_binds_plans(budget):
    """0 is off: the same plans, step for step, as a threshold of the whole budget (which no chunk
    can pass), and every chunk but a step's last is its prompt's whole remainder (the budget goes
    to the oldest prompts first, as before pacing)."""
    plans = drive(0, budget, seed=budget)
    assert plans == drive(budget, budget, seed=budget)
    for plan in plans:
        assert all(end == length for _, _, end, length in plan[:-1])


def test_a_negative_threshold_is_refused():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(2, 16, 8, 16, long_prefill_token_threshold=-1)
