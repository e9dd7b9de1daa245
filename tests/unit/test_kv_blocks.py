"""Paged-KV bookkeeping (policies/kv_blocks.py): pages per sequence as it grows, freeing, the pool
index of a position, running out of pages, and preemption of the newest sequences first."""

import random

import pytest

from policies.kv_blocks import BlockManager, OutOfPages


def test_a_prompt_gets_just_enough_pages_lowest_first_never_the_reserved_one():
    blocks = BlockManager(num_pages=8, page_size=4, reserved=1)
    assert blocks.capacity_tokens == 28 and blocks.num_free == 7
    assert blocks.allocate("a", 9) == [1, 2, 3]  # 9 tokens: 3 pages of 4; page 0 is the scratch page
    assert blocks.allocate("b", 4) == [4]
    assert blocks.num_free == 3 and blocks.tokens("a") == 9


def test_growing_takes_a_page_only_when_crossing_into_one():
    blocks = BlockManager(num_pages=8, page_size=4)
    blocks.allocate("a", 3)
    assert not blocks.needs_page("a")
    blocks.append("a")  # position 3: the last of page 1
    assert blocks.block_table("a") == [1] and blocks.needs_page("a")
    blocks.append("a")  # position 4 starts a new page
    assert blocks.block_table("a") == [1, 2] and blocks.tokens("a") == 5


def test_slot_is_page_times_page_size_plus_offset():
    blocks = BlockManager(num_pages=8, page_size=4)
    blocks.allocate("x", 2)
    blocks.allocate("a", 6)  # pages 2, 3
    assert [blocks.slot("a", p) for p in range(6)] == [8, 9, 10, 11, 12, 13]
    assert blocks.slot("x", 1) == 5


def test_freed_pages_are_reused_lowest_first():
    blocks = BlockManager(num_pages=6, page_size=2)
    blocks.allocate("a", 4)  # 1, 2
    blocks.allocate("b", 2)  # 3
    blocks.free("a")
    blocks.free("a")  # twice is harmless
    assert blocks.allocate("c", 6) == [1, 2, 4]


def test_out_of_pages_changes_nothing():
    blocks = BlockManager(num_pages=4, page_size=2)
    blocks.allocate("a", 6)  # 3 pages, full: the pool is spent
    assert not blocks.can_allocate(1)
    with pytest.raises(OutOfPages):
        blocks.allocate("b", 1)
    with pytest.raises(OutOfPages):
        blocks.append("a")  # position 6 would start a fourth page
    assert blocks.tokens("a") == 6 and blocks.num_free == 0
    with pytest.raises(ValueError):
        blocks.allocate("a", 1)  # a sequence is allocated once


def test_a_step_preempts_the_newest_until_the_rest_fit():
    blocks = BlockManager(num_pages=6, page_size=2)  # 5 usable pages
    for seq in ("old", "mid", "new"):
        blocks.allocate(seq, 2)  # each fills one page exactly: the next position needs a page
    blocks.allocate("newest", 3)  # 2 pages, room for one more position
    assert blocks.num_free == 0
    # old, mid and new each need a page; newest does not. Preempting newest frees 2: old and mid fit.
    preempted, grown = blocks.reserve_step(["old", "mid", "new", "newest"])
    assert preempted == ["newest", "new"] and grown == ["old", "mid"]
    assert [blocks.tokens(s) for s in ("old", "mid")] == [3, 3]
    assert blocks.num_free == 1  # new's page came back too


def test_a_step_with_room_preempts_nobody():
    blocks = BlockManager(num_pages=10, page_size=4)
    for seq in ("a", "b"):
        blocks.allocate(seq, 4)
    assert blocks.reserve_step(["a", "b"]) == ([], ["a", "b"])  # both cross into a new page
    assert blocks.tokens("a") == blocks.tokens("b") == 5


def test_invariants_hold_under_a_random_workload():
    """No page is held twice or lost, reserved pages are never handed out, and every sequence's
    pages cover exactly its tokens, whatever mix of admissions, steps and finishes comes."""
    rng = random.Random(0)
    blocks = BlockManager(num_pages=40, page_size=4, reserved=2)
    running: list[str] = []
    for n in range(2000):
        action = rng.random()
        if action < 0.3 and blocks.can_allocate(prompt := rng.randint(1, 20)):
            blocks.allocate(f"s{n}", prompt)
            running.append(f"s{n}")
        elif action < 0.9 and running:
            growing = {s for s in running if blocks.needs_page(s)}
            preempted, grown = blocks.reserve_step(running)
            assert set(grown) == growing - set(preempted)
            assert preempted == running[len(running) - len(preempted) :][::-1]  # the newest, newest first
            running = running[: len(running) - len(preempted)]
        elif running:
            blocks.free(running.pop(rng.randrange(len(running))))
        held = [p for s in running for p in blocks.block_table(s)]
        assert len(held) == len(set(held)) and min(held, default=2) >= 2
        assert len(held) + blocks.num_free == 38
        assert all(blocks.pages_for(blocks.tokens(s)) == len(blocks.block_table(s)) for s in running)
