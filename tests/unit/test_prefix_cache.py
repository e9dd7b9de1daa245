"""Prefix caching's bookkeeping (policies/prefix_hash.py, prefix_cache.py, kv_blocks.py, and the
scheduler's admission): the hash chain, shared full pages with reference counts, eviction of idle
cached pages only after the free ones and least recently released first, a held page never
evicted, the last partial page never shared, a fully cached prompt computing its last page again,
preemption releasing references, and cached tokens costing no prefill budget."""

import random

import pytest

from policies.kv_blocks import BlockManager, OutOfPages
from policies.prefix_hash import adapter_salt, page_hashes
from workers.serving.sampling import SamplingParams
from workers.serving.scheduler import Scheduler, Sequence, new_sequence

PS = 4  # tokens per page in these tests


def hashes(tokens: list[int], salt: bytes = b"") -> list[bytes]:
    return page_hashes(tokens, PS, salt)


def test_a_page_hash_covers_its_tokens_every_page_before_and_the_salt():
    a = hashes(list(range(10)))
    assert len(a) == 2  # full pages only: the partial third is never hashed
    assert hashes(list(range(8)) + [99]) == a  # what follows the full pages does not matter
    changed_first = hashes([7, *range(1, 10)])
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # the chain carries an early change on
    assert hashes(list(range(4)) + [9, 9, 9, 9])[0] == a[0]
    assert hashes(list(range(10)), adapter_salt("x", "/a", 1)) != a
    assert adapter_salt("x", "/a", 1) != adapter_salt("x", "/a", 2)  # another load of the same adapter
    assert page_hashes(list(range(12)), PS, b"", known=a) == hashes(list(range(12)))  # extended, same chain


def test_a_second_prompt_reuses_the_first_ones_full_pages_and_computes_the_rest():
    blocks = BlockManager(num_pages=16, page_size=PS)
    first = list(range(10))  # pages 1, 2 full; page 3 partial
    assert blocks.allocate("a", 10, hashes(first)) == [1, 2, 3]
    second = first[:9] + [50, 51, 52]  # shares 9 tokens: two full pages, then differs mid-page
    table = blocks.allocate("b", 12, hashes(second))
    assert table[:2] == [1, 2] and 3 not in table  # a's partial last page is its own
    assert blocks.cached_tokens("b") == 8 and blocks.cached_tokens("a") == 0
    assert blocks.num_free == 15 - 3 - 1


def test_a_prompt_ending_on_a_page_boundary_fully_cached_computes_its_last_page_again():
    blocks = BlockManager(num_pages=16, page_size=PS)
    prompt = list(range(8))
    blocks.allocate("a", 8, hashes(prompt))  # pages 1, 2: both full and cached
    assert blocks.prefix.num_cached == 2
    table = blocks.allocate("b", 8, hashes(prompt))
    assert table[0] == 1 and table[1] not in (1, 2)  # the page of its last token is computed: logits
    assert blocks.cached_tokens("b") == 4
    assert blocks.prefix.num_cached == 2  # b's copy of page 2 is private: a hash answers to one page


def test_a_one_page_prompt_reuses_nothing():
    blocks = BlockManager(num_pages=8, page_size=PS)
    blocks.allocate("a", 4, hashes([1, 2, 3, 4]))
    assert blocks.cached_prefix(4, hashes([1, 2, 3, 4])) == []
    assert blocks.allocate("b", 5, hashes([1, 2, 3, 4, 5])) == [1, 2]  # a longer one does


def test_shared_pages_are_freed_only_when_the_last_holder_lets_go():
    blocks = BlockManager(num_pages=8, page_size=PS)
    prompt = list(range(9))
    blocks.allocate("a", 9, hashes(prompt))
    blocks.allocate("b", 9, hashes(prompt))
    assert blocks.block_table("a")[:2] == blocks.block_table("b")[:2] == [1, 2]
    blocks.free("a")
    assert blocks.block_table("b")[:2] == [1, 2] and not blocks.prefix.is_idle(1)
    blocks.allocate("c", 4 * PS)  # takes every free page (3, 5, 6, 7); 1 and 2 are held by b: not evictable
    with pytest.raises(OutOfPages):
        blocks.allocate("d", 1)
    blocks.free("b")
    assert blocks.prefix.is_idle(1) and blocks.prefix.is_idle(2)
    assert blocks.num_free == 3  # b's private page 4 and the idle cached pages 1, 2
    assert blocks.allocate("d", 3 * PS) == [4, 2, 1]


def test_free_pages_go_before_cached_ones_and_cached_ones_least_recently_released_first():
    blocks = BlockManager(num_pages=8, page_size=PS)  # pages 1..7
    blocks.allocate("a", 9, hashes(list(range(9))))  # 1, 2 cached, 3 private
    blocks.allocate("b", 9, hashes(list(range(100, 109))))  # 4, 5 cached, 6 private
    blocks.free("a")
    blocks.free("b")
    assert blocks.num_free == 7 and blocks.prefix.num_idle == 4
    assert blocks.allocate("x", 3 * PS) == [3, 6, 7]  # the free pages first, every cached one kept
    # then the idle ones: a's before b's (released earlier), each chain's tail before its head
    assert blocks.allocate("y", 2 * PS) == [2, 1]
    assert blocks.cached_prefix(9, hashes(list(range(9)))) == []  # a's prefix is gone
    assert blocks.cached_prefix(9, hashes(list(range(100, 109)))) == [4, 5]  # b's is not


def test_reusing_an_idle_page_makes_it_recently_used():
    blocks = BlockManager(num_pages=6, page_size=PS)  # pages 1..5
    blocks.allocate("a", 5, hashes(list(range(5))))  # 1 cached, 2 private
    blocks.allocate("b", 5, hashes(list(range(50, 55))))  # 3 cached, 4 private
    blocks.free("a")
    blocks.free("b")  # idle, oldest first: 1, 3
    blocks.allocate("c", 5, hashes(list(range(5))))  # reuses 1: held, not idle
    blocks.free("c")  # idle now: 3, 1
    assert blocks.allocate("d", 4 * PS) == [2, 4, 5, 3]


def test_a_page_a_decode_step_filled_becomes_reusable():
    blocks = BlockManager(num_pages=8, page_size=PS)
    tokens = [5, 6, 7]
    blocks.allocate("a", 3, hashes(tokens))
    assert blocks.prefix.num_cached == 0
    blocks.reserve_step(["a"])  # position 3: page 1 full as of this step
    tokens.append(8)
    blocks.cache_page("a", 0, hashes(tokens)[0])
    assert blocks.cached_prefix(5, hashes([*tokens, 9])) == [1]


def test_admission_cost_counts_new_pages_and_reused_pages_nobody_holds():
    blocks = BlockManager(num_pages=16, page_size=PS)
    prompt = list(range(13))
    blocks.allocate("a", 13, hashes(prompt))
    hits = blocks.cached_prefix(13, hashes(prompt))
    assert hits == [1, 2, 3] and blocks.pages_taken(hits, 14) == 1  # held by a: free to share
    blocks.free("a")
    assert blocks.pages_taken(hits, 14) == 4  # idle: reusing them takes them out of num_free
    free = blocks.num_free
    blocks.allocate("b", 14, hashes(prompt))
    assert free - blocks.num_free == 4


def test_preemption_releases_references_and_re_prefill_hits_the_cache():
    blocks = BlockManager(num_pages=6, page_size=PS)  # pages 1..5
    prompt = list(range(8))
    blocks.allocate("old", 8, hashes(prompt))  # 1, 2
    blocks.allocate("new", 9, hashes([*prompt, 77]))  # shares 1, 2; 3
    blocks.allocate("other", 8)  # 4, 5: the pool is spent
    preempted, grown = blocks.reserve_step(["old", "other", "new"])
    assert preempted == ["new", "other"] and grown == ["old"]
    assert blocks.block_table("old") == [1, 2, 3]  # new's page 3, freed by its preemption
    blocks.free("old")
    assert blocks.cached_prefix(9, hashes([*prompt, 77])) == [1, 2]  # new's re-prefill reuses them


def test_clearing_forgets_every_prefix_and_frees_idle_pages_once():
    blocks = BlockManager(num_pages=8, page_size=PS)
    blocks.allocate("a", 9, hashes(list(range(9))))
    blocks.allocate("b", 9, hashes(list(range(9))))
    blocks.free("a")
    blocks.clear_prefix_cache()
    assert blocks.prefix.num_cached == 0 and blocks.cached_prefix(9, hashes(list(range(9)))) == []
    blocks.free("b")  # its shared pages are private now: back to the free list, not idle
    assert blocks.num_free == 7 and blocks.prefix.num_idle == 0
    assert sorted(blocks.allocate("c", 7 * PS)) == list(range(1, 8))


def test_invariants_hold_under_a_random_workload_with_shared_prefixes():
    """Reference counts match the tables, a held page is never idle or free, a page is free, idle
    or held (never two), reserved pages are never handed out, every reused page answers to the
    hash of the sequence's page there, whatever mix of admissions, steps, finishes and clears."""
    rng = random.Random(1)
    blocks = BlockManager(num_pages=40, page_size=PS, reserved=2)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    running: dict[str, list[int]] = {}
    for n in range(3000):
        action = rng.random()
        if action < 0.3:
            tokens = rng.choice(prefixes)[: rng.randint(1, 12)] + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
            h = hashes(tokens)
            hits = blocks.cached_prefix(len(tokens), h)
            if blocks.pages_taken(hits, len(tokens)) <= blocks.num_free:
                table = blocks.allocate(f"s{n}", len(tokens), h)
                assert table[: len(hits)] == hits and blocks.cached_tokens(f"s{n}") == len(hits) * PS
                running[f"s{n}"] = tokens
        elif action < 0.85 and running:
            order = list(running)
            preempted, _ = blocks.reserve_step(order)
            for s in preempted:
                del running[s]
            for s, tokens in running.items():
                tokens.append(rng.randrange(50))
                if len(tokens) % PS == 0:
                    blocks.cache_page(s, len(tokens) // PS - 1, hashes(tokens)[-1])
        elif action < 0.99 and running:
            blocks.free(s := rng.choice(list(running)))
            del running[s]
        else:
            blocks.clear_prefix_cache()
        held = {p for s in running for p in blocks.block_table(s)}
        refs = {p: sum(p in blocks.block_table(s) for s in running) for p in held}
        assert blocks._refs == refs and min(held, default=2) >= 2
        assert not any(blocks.prefix.is_idle(p) for p in held) and not held & set(blocks._free)
        assert len(held) + blocks.num_free == 38
        for s, tokens in running.items():
            table = blocks.block_table(s)
            assert blocks.pages_for(blocks.tokens(s)) == len(table) and blocks.tokens(s) == len(tokens)
            for page, h in zip(table, hashes(tokens)):
                assert blocks.prefix._hash_of.get(page, h) == h  # a shared page holds these tokens


# ---------------------------------------------------------------- the scheduler's part


def caching_scheduler(num_pages: int = 32, max_num_batched_tokens: int = 1000, max_num_seqs: int = 4) -> Scheduler:
    blocks = BlockManager(num_pages, PS)
    max_model_len = min(32, blocks.capacity_tokens)
    return Scheduler(max_num_seqs, max_model_len, 8, max_num_batched_tokens, blocks=blocks, prefix_caching=True)


def prompt(request_id: str, tokens: list[int], adapter: tuple[str, str] | None = None) -> Sequence:
    return new_sequence(tokens, SamplingParams(), request_id, adapter=adapter)


def test_an_admitted_prompt_starts_its_prefill_after_its_cached_pages_and_its_table_holds_them():
    s = caching_scheduler()
    s.add(a := prompt("a", list(range(10))))
    s.admit()
    s.take_edits()
    s.add(b := prompt("b", list(range(9)) + [50]))
    s.admit()
    assert b.prefill_start == b.cached_tokens == 8 and a.cached_tokens == 0 and a.prefill_start == a.length
    edits = s.take_edits()
    assert edits[:6] == [b.slot, 0, 1, b.slot, 1, 2]  # its first two entries: a's pages


def test_cached_tokens_count_against_neither_the_prefill_budget_nor_the_pool():
    s = caching_scheduler(num_pages=9, max_num_batched_tokens=20)  # 8 usable pages
    s.add(prompt("a", list(range(16))))
    s.admit()  # 4 pages, all cached, held by a
    s.reserve_decode()  # a's next position takes a fifth page
    s.add(b := prompt("b", list(range(16)) + [60]))
    s.add(c := prompt("c", list(range(16)) + [61]))
    # each needs 5 pages for 18 positions and computes 1 token: 16 are a's, shared
    assert s.admit() == [b, c]
    assert b.prefill_start == c.prefill_start == 16 and s.blocks.num_free == 1


def test_a_sequence_whose_adapter_is_not_granted_yet_is_looked_up_once_it_is():
    """An adapter request's salt names the load of its adapter, known when `ready` grants its slot:
    before that it is admitted as if nothing were cached, then reuses what that load cached."""
    s = caching_scheduler()
    tokens = list(range(12))
    first = prompt("first", tokens, adapter=("x", "/x"))
    assert first.cache_salt is None
    s.add(first)

    def grant(seq: Sequence) -> bool:
        seq.cache_salt = adapter_salt("x", "/x", 1)
        return True

    s.admit(grant)
    s.add(second := prompt("second", tokens, adapter=("x", "/x")))
    s.add(other := prompt("other", tokens))  # the base model: another salt
    s.admit(lambda seq: grant(seq) if seq.adapter else True)
    assert (first.cached_tokens, second.cached_tokens, other.cached_tokens) == (0, 8, 0)


def test_a_preempted_sequence_is_prefilled_again_from_its_cached_pages():
    s = caching_scheduler(num_pages=7, max_num_seqs=2)  # 6 usable pages
    s.add(old := prompt("old", list(range(8))))
    s.add(new := prompt("new", list(range(8)) + [70, 71, 72]))
    s.admit()  # old: 2 pages; new: shares them, plus 1
    for seq in (old, new):
        seq.output_ids.append(99)
    preempted = []
    while not preempted:  # the pool runs out within a few pages
        preempted = s.reserve_decode()
        for seq in s.running.values():
            seq.output_ids.append(99)
    assert preempted == [new] and new.cached_tokens == 8  # its first admission's count stays
    s.finish(old, "length")
    s.admit()
    # every full page it had written is cached: its prompt's and the ones its decode steps filled
    assert new.prefill_start == PS * ((new.length - 1) // PS) > 8
