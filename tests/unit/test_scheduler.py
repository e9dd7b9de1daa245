"""The continuous-batching scheduler on its own: slots, queueing, prefill budget, rejection, abort."""

from __future__ import annotations

import pytest

from policies.kv_blocks import BlockManager
from workers.serving.sampling import InvalidRequest, SamplingParams
from workers.serving.scheduler import QueueFull, RequestLimits, Scheduler, Sequence


def make_scheduler(max_num_seqs=3, max_model_len=64, max_waiting=8, max_num_batched_tokens=1000) -> Scheduler:
    return Scheduler(max_num_seqs, max_model_len, max_waiting, max_num_batched_tokens)


def seq(request_id: str, prompt_len: int = 4) -> Sequence:
    return Sequence(request_id, list(range(1, prompt_len + 1)), SamplingParams(), seed=0)


def test_admit_fills_free_slots_lowest_first():
    """New sequences take the lowest free slots, in arrival order, and become running."""
    s = make_scheduler(max_num_seqs=3)
    for rid in "abc":
        s.add(seq(rid))
    admitted = s.admit()
    assert [q.request_id for q in admitted] == ["a", "b", "c"]
    assert [q.slot for q in admitted] == [0, 1, 2]
    assert set(s.running) == {"a", "b", "c"}
    assert not s.waiting and not s.free_slots
    assert s.num_unfinished == 3


def test_finish_frees_slot_and_next_admission_reuses_it():
    """A sequence leaving the batch frees its slot at once; the next admission gets that slot, and
    the lowest free slot is always handed out first whatever the order of release."""
    s = make_scheduler(max_num_seqs=3)
    seqs = {rid: seq(rid) for rid in "abc"}
    for q in seqs.values():
        s.add(q)
    s.admit()
    s.finish(seqs["b"], "length")
    assert seqs["b"].finish_reason == "length"
    assert "b" not in s.running
    assert s.free_slots == [1]
    d = seq("d")
    s.add(d)
    assert s.admit() == [d]
    assert d.slot == 1

    s.finish(seqs["c"], "stop")
    s.finish(seqs["a"], "stop")  # released out of order: slot 2 then slot 0
    e, f = seq("e"), seq("f")
    s.add(e)
    s.add(f)
    s.admit()
    assert (e.slot, f.slot) == (0, 2)
    assert {q.slot for q in s.running.values()} == {0, 1, 2}


def test_queueing_when_all_slots_busy_is_fifo():
    """With every slot busy, new requests wait; each release admits the oldest waiter."""
    s = make_scheduler(max_num_seqs=2)
    running = [seq("r0"), seq("r1")]
    for q in running:
        s.add(q)
    s.admit()
    waiters = [seq(f"w{i}") for i in range(4)]
    for i, q in enumerate(waiters):
        s.add(q)
        assert len(s.waiting) == i + 1
        assert s.admit() == []  # no slot free: nothing moves
    assert s.num_unfinished == 6

    s.finish(running[1], "length")
    assert [q.request_id for q in s.admit()] == ["w0"]
    assert waiters[0].slot == 1
    s.finish(running[0], "length")
    s.finish(waiters[0], "length")
    assert [q.request_id for q in s.admit()] == ["w1", "w2"]
    assert [q.request_id for q in s.waiting] == ["w3"]


def chunks(s: Scheduler) -> list[tuple[str, int, int]]:
    """This step's prefill chunks, as (request, start, end)."""
    return [(q.request_id, q.prefill_start, q.prefill_end) for q in s.chunks]


def test_a_step_carries_at_most_the_token_budget_and_long_prompts_go_in_chunks():
    """Prompt tokens per step stay within max_num_batched_tokens less one per decoding sequence: a
    prompt over the budget is prefilled in chunks over several steps (it decodes only after its
    last), its chunks go before new admissions, and the prompts after it wait or are chunked too."""
    s = make_scheduler(max_num_seqs=5, max_model_len=100, max_num_batched_tokens=10)
    big, long2, short = seq("big", 25), seq("long2", 8), seq("short", 2)
    for q in (big, long2, short):
        s.add(q)
    assert s.admit() == [big] and chunks(s) == [("big", 0, 10)]
    assert big.in_prefill and s.reserve_decode() == [] and s.blocks.tokens("big") == 25  # no decode yet
    assert s.admit() == [] and chunks(s) == [("big", 10, 20)]  # its chunk first: nothing left for long2
    assert s.admit() == [long2] and chunks(s) == [("big", 20, 25), ("long2", 0, 5)]
    assert not big.in_prefill and long2.in_prefill
    s.reserve_decode()  # big decodes from now on: one token of the next step's budget
    assert s.admit() == [short] and chunks(s) == [("long2", 5, 8), ("short", 0, 2)]
    assert not long2.in_prefill and not short.in_prefill
    assert s.admit() == [] and s.chunks == [] and short.prefill_start == 2


def test_prefill_budget_is_fifo_not_best_fit():
    """Waiting prompts go in in order: a later small one never overtakes the one being chunked."""
    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=10)
    a, b, c = seq("a", 6), seq("b", 12), seq("c", 1)
    for q in (a, b, c):
        s.add(q)
    assert s.admit() == [a, b] and chunks(s) == [("a", 0, 6), ("b", 0, 4)]
    assert [q.request_id for q in s.waiting] == ["c"]
    s.reserve_decode()
    # 10 less a's decode: b's last 8 tokens, then c (after b, never before it) in the one left
    assert s.admit() == [c] and chunks(s) == [("b", 4, 12), ("c", 0, 1)]


def test_decodes_never_starve_prefill():
    """However many sequences decode, a step still carries some prompt (a page's worth at least)."""
    s = Scheduler(4, 64, 8, 3, blocks=BlockManager(64, 4))
    for name in "abc":
        s.add(seq(name, 1))
    assert len(s.admit()) == 3 and len(chunks(s)) == 3
    s.reserve_decode()
    late = seq("late", 9)
    s.add(late)
    assert s.admit() == [late] and chunks(s) == [("late", 0, 3)]  # 3 decodes fill the budget of 3


def test_a_preempted_sequence_in_its_prefill_starts_over():
    """A sequence preempted between two of its chunks (a decode needed its pages) frees them and is
    prefilled from the start again when admitted again."""
    s = Scheduler(2, 16, 8, 3, blocks=BlockManager(6, 4))  # 5 usable pages of 4 tokens, 3 tokens a step
    old, new = seq("old", 4), seq("new", 11)
    s.add(old)
    s.add(new)
    preempted = []
    for _ in range(10):
        s.admit()
        chunks(s)
        preempted = s.reserve_decode()
        if preempted:
            break
    assert preempted == [new] and not new.in_prefill and new.prefill_start > 0 and new not in s.prefilling.values()
    assert list(s.waiting) == [new] and "new" not in s.running
    s.finish(old, "stop")
    assert s.admit() == [new] and chunks(s) == [("new", 0, 3)]


def test_empty_prompt_rejected():
    """An empty prompt is an InvalidRequest, and is not queued."""
    s = make_scheduler()
    with pytest.raises(InvalidRequest, match="empty"):
        s.add(Sequence("x", [], SamplingParams(), seed=0))
    assert s.num_unfinished == 0


def test_prompt_longer_than_max_model_len_rejected():
    """A prompt longer than max_model_len is rejected with a message naming the limit; one of exactly
    max_model_len tokens is accepted."""
    s = make_scheduler(max_model_len=16)
    with pytest.raises(InvalidRequest, match=r"max_model_len=16") as info:
        s.add(seq("x", 17))
    assert "17" in str(info.value)
    assert s.num_unfinished == 0
    s.add(seq("ok", 16))
    assert s.num_unfinished == 1


def test_prompt_ids_outside_vocab_rejected():
    """With a vocab size, negative, too large or non-integer prompt ids are an InvalidRequest (one
    bad id inside the batched step would fail every request); without one, ids are not checked."""
    s = make_scheduler()
    s.limits = RequestLimits(s.max_model_len, 10, s.limits.capacity)
    for bad in ([1, 10], [-1, 2], [1, 2.0], [1, "3"], [1, 2**64], [None]):
        with pytest.raises(InvalidRequest, match=r"\[0, 10\)"):
            s.add(Sequence("x", bad, SamplingParams(), seed=0))
    assert s.num_unfinished == 0
    s.add(Sequence("ok", [0, 9], SamplingParams(), seed=0))
    Scheduler(2, 64, 8, 100).limits.check_prompt([10**6])  # no vocab size given: no check


def test_duplicate_request_id_rejected():
    """A second unfinished request under the same id is rejected (it would shadow the first in the
    running table and leak its slot); once the first finishes, the id may be used again."""
    s = make_scheduler(max_num_seqs=1)
    first = seq("dup")
    s.add(first)
    with pytest.raises(InvalidRequest, match="dup"):
        s.add(seq("dup"))  # while waiting
    s.admit()
    with pytest.raises(InvalidRequest, match="dup"):
        s.add(seq("dup"))  # while running
    assert s.num_unfinished == 1
    s.finish(first, "length")
    s.add(seq("dup"))
    assert s.num_unfinished == 1


def test_invalid_request_is_a_value_error():
    """Serving layers map ValueError to 400; InvalidRequest must stay one."""
    assert issubclass(InvalidRequest, ValueError)


def test_queue_full_at_capacity():
    """At most max_num_seqs + max_waiting requests are held; the next one raises QueueFull and is
    not queued, and room frees up again when a request finishes."""
    s = make_scheduler(max_num_seqs=2, max_waiting=3)
    assert s.limits.capacity == 5
    seqs = [seq(f"r{i}") for i in range(5)]
    for q in seqs[:2]:
        s.add(q)
    s.admit()
    for q in seqs[2:]:
        s.add(q)
    assert s.num_unfinished == 5
    with pytest.raises(QueueFull):
        s.add(seq("extra"))
    assert s.num_unfinished == 5
    assert "extra" not in [q.request_id for q in s.waiting]

    s.finish(seqs[0], "length")
    s.add(seq("extra"))  # a slot's worth of room again
    assert s.num_unfinished == 5


def test_queue_full_counts_waiting_when_nothing_admitted():
    """Capacity counts waiting requests too: with no admit() in between, capacity adds succeed."""
    s = make_scheduler(max_num_seqs=1, max_waiting=1)
    s.add(seq("a"))
    s.add(seq("b"))
    with pytest.raises(QueueFull):
        s.add(seq("c"))


def test_abort_waiting_sequence():
    """Finishing a waiting sequence removes it from the queue without touching slots or the order
    of the others."""
    s = make_scheduler(max_num_seqs=1)
    r, w1, w2, w3 = seq("r"), seq("w1"), seq("w2"), seq("w3")
    for q in (r, w1, w2, w3):
        s.add(q)
    s.admit()
    found = s.find("w2")
    assert found is w2
    s.finish(found, "abort")
    assert w2.finish_reason == "abort"
    assert [q.request_id for q in s.waiting] == ["w1", "w3"]
    assert s.free_slots == []
    assert s.find("w2") is None
    s.finish(r, "length")
    assert s.admit() == [w1]


def test_abort_running_sequence_frees_slot():
    """Finishing a running sequence (abort) frees its slot for the next waiter."""
    s = make_scheduler(max_num_seqs=2)
    a, b, c = seq("a"), seq("b"), seq("c")
    for q in (a, b, c):
        s.add(q)
    s.admit()
    assert s.find("a") is a
    s.finish(s.find("a"), "abort")
    assert "a" not in s.running and s.find("a") is None
    assert s.free_slots == [0]
    assert s.admit() == [c]
    assert c.slot == 0


def test_find_unknown_request():
    """find() answers None for ids the scheduler does not hold."""
    s = make_scheduler()
    s.add(seq("a"))
    assert s.find("nope") is None
    assert s.find("a") is not None


def test_sequence_length_counts_prompt_and_output():
    """Sequence.length is prompt plus generated tokens (the engine's position and length limit)."""
    q = seq("a", 5)
    assert q.length == 5
    q.output_ids += [7, 8]
    assert q.length == 7


# ---------------------------------------------------------------- paging


def paged_scheduler(num_pages: int, page_size: int = 4, max_num_seqs: int = 4, max_model_len: int = 12) -> Scheduler:
    return Scheduler(max_num_seqs, max_model_len, 8, 1000, blocks=BlockManager(num_pages, page_size))


def table_of(edits: list[int]) -> dict[int, dict[int, int]]:
    out: dict[int, dict[int, int]] = {}
    for slot, index, page in zip(edits[::3], edits[1::3], edits[2::3]):
        out.setdefault(slot, {})[index] = page
    return out


def test_admission_needs_pages_not_only_slots():
    """Two 7-token sequences take 2 pages each (their tokens and the first decode's); a third waits
    with a free slot until one finishes and gives its pages back."""
    s = paged_scheduler(num_pages=1 + 5)
    a, b, c = seq("a", 7), seq("b", 7), seq("c", 7)
    for q in (a, b, c):
        s.add(q)
    assert s.admit() == [a, b]
    assert list(s.waiting) == [c] and s.free_slots
    s.finish(a, "stop")
    assert s.admit() == [c]


def test_admission_leaves_the_pages_running_sequences_need_this_step():
    """A running sequence at a page boundary needs a new page this step: a waiting one that would
    take it is not admitted."""
    s = paged_scheduler(num_pages=1 + 3)
    a = seq("a", 3)
    s.add(a)
    s.admit()
    s.reserve_decode()  # a: 4 tokens, one full page; its next position needs a second page
    a.output_ids.append(9)
    s.add(b := seq("b", 4))  # needs 2 pages (4 tokens + 1)
    assert s.admit() == [] and list(s.waiting) == [b]


def test_idle_sequences_take_neither_budget_nor_a_page():
    """A running sequence idle this step (its last token is in flight) leaves its token of the
    budget and the page its next position would need to the waiting prompts."""
    s = Scheduler(3, 12, 8, 4, blocks=BlockManager(1 + 3, 4))
    a = seq("a", 3)
    s.add(a)
    s.admit()
    s.reserve_decode()  # a: 4 tokens, one full page; its next position would need a second page
    a.output_ids.append(9)
    s.add(b := seq("b", 4))  # needs 2 pages (4 tokens + 1): only with a's next page left free
    assert s.admit() == []
    assert s.admit(idle={"a"}) == [b] and chunks(s) == [("b", 0, 4)]  # the whole budget of 4


def test_edits_describe_every_page_handed_out():
    s = paged_scheduler(num_pages=1 + 8)
    a, b = seq("a", 5), seq("b", 3)
    s.add(a)
    s.add(b)
    s.admit()
    assert table_of(s.take_edits()) == {
        a.slot: dict(enumerate(s.blocks.block_table("a"))),
        b.slot: dict(enumerate(s.blocks.block_table("b"))),
    }
    assert s.take_edits() == []
    s.reserve_decode()  # a: 6 tokens in 2 pages (no new page); b: 4 tokens in 1 page
    assert s.take_edits() == []
    b.output_ids.append(1)
    s.reserve_decode()  # b crosses into its second page
    assert table_of(s.take_edits()) == {b.slot: {1: s.blocks.block_table("b")[1]}}


def test_preemption_takes_the_newest_and_requeues_them_first_with_their_tokens():
    """When a step needs more pages than are free, the newest running sequences give theirs back and
    wait at the front of the queue, oldest first, output kept; they come back as whole sequences
    (prompt and output so far) once pages are free again."""
    s = paged_scheduler(num_pages=1 + 4, page_size=4)
    old, mid, new = seq("old", 4), seq("mid", 4), seq("new", 3)
    late = seq("late", 2)
    for q in (old, mid, new):
        s.add(q)
    assert s.admit() == [old, mid]  # 2 pages each (4 tokens + the first decode)
    s.reserve_decode()
    for q in (old, mid):
        q.output_ids.append(7)
    s.finish(mid, "stop")
    assert s.admit() == [new]
    s.add(late)
    new.output_ids += [5, 6]  # new: 3 prompt tokens + 2 output = 5 tokens
    old.output_ids += [8, 8, 8]  # old: 8 tokens, at a page boundary
    s.blocks.append("old"), s.blocks.append("old"), s.blocks.append("old")
    s.blocks.append("new"), s.blocks.append("new")
    s.take_edits()
    assert s.blocks.num_free == 0
    preempted = s.reserve_decode()
    assert preempted == [new] and list(s.running) == ["old"]
    assert list(s.waiting) == [new, late] and new.slot == -1 and new.output_ids == [5, 6]
    assert new.token_ids == [1, 2, 3, 5, 6] and s.num_preempted == 1
    s.finish(old, "stop")
    assert s.admit() == [new, late]
    assert s.blocks.tokens("new") == new.length == 5


def test_a_pool_smaller_than_one_sequence_is_refused():
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        paged_scheduler(num_pages=1 + 3, page_size=4, max_model_len=13)
