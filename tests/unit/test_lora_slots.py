"""The LoRA slot table: loaded adapters are found again, the least recently used idle adapter is
evicted, a pinned one never is, and a request waits when every slot is pinned."""

from policies.lora_slots import AdapterSlots, Grant

A, B, C = ("a", "/a"), ("b", "/b"), ("c", "/c")


def test_a_loaded_adapter_is_found_without_loading():
    slots = AdapterSlots(2)
    assert slots.acquire(A) == Grant(1, load=True)
    slots.release(1)
    assert slots.acquire(A) == Grant(1, load=False)
    assert slots.report() == {"a": {"slot": 1, "requests": 1}}


def test_the_least_recently_used_idle_adapter_is_evicted_and_a_pinned_one_never():
    slots = AdapterSlots(2)
    slots.acquire(A)
    slots.acquire(B)
    slots.release(1)  # A idle since before B was released
    slots.release(2)
    slots.acquire(A)  # A used again: B is now the least recently used
    slots.release(1)
    assert slots.acquire(C) == Grant(2, load=True, evicted=B)
    assert slots.acquire(B) == Grant(1, load=True, evicted=A)
    assert slots.acquire(A) is None  # both slots pinned (C, B): A waits
    slots.release(2)
    assert slots.acquire(A) == Grant(2, load=True, evicted=C)


def test_a_new_path_under_an_old_name_is_a_new_adapter():
    slots = AdapterSlots(2)
    slots.acquire(A)
    assert slots.acquire(("a", "/a-v2")).slot == 2


def test_drop_frees_an_idle_slot_and_leaves_a_pinned_one_serving_only_its_requests():
    slots = AdapterSlots(1)
    slots.acquire(A)
    slots.drop(A)
    assert slots.slot_of(A) is None  # no later request finds it
    assert slots.acquire(B) is None  # its request still runs with it: the slot is not free
    slots.release(1)
    assert slots.acquire(B) == Grant(1, load=True)
    slots.release(1)
    slots.drop(B)
    assert slots.slot_of(B) is None and slots.acquire(A) == Grant(1, load=True)


def test_an_adapter_dropped_while_pinned_keeps_its_slot_for_its_requests_and_no_later_one():
    slots = AdapterSlots(2)
    old = slots.acquire(("a", "/p"))
    assert old.load and old.slot == 1
    slots.drop(("a", "/p"))  # its files changed while a request ran with them
    new = slots.acquire(("a", "/p"))
    assert new.load and new.slot == 2  # not slot 1: its request still reads it
    assert slots.acquire(("b", "/q")) is None  # slot 1 is neither free nor evictable while pinned
    slots.release(old.slot)
    assert slots.dropped == set()
    b = slots.acquire(("b", "/q"))
    assert b.load and b.slot == 1 and b.evicted is None
