"""Which adapter holds which LoRA slot: pure bookkeeping, so eviction is testable in microseconds.

Slots 1..max_loras hold adapters (0 is the null adapter). A request pins its adapter's slot from the
moment it is accepted until it finishes (the engine releases the pins of queued requests when the
head of its queue finds every slot pinned, so none waits behind those queued after it); an adapter
not pinned by any request stays loaded (a later request finds it without loading) until its slot is
needed for another: the least recently used unpinned adapter is evicted. A pinned slot is never
evicted, so when every slot is pinned a request for yet another adapter waits. An adapter dropped
while requests pin its slot (its files changed under it) is found by no later request; its slot
serves the requests that pin it and is free once they finish."""

from __future__ import annotations

from dataclasses import dataclass

# The layers a LoRA adapter can target, by PEFT's module names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AdapterKey = tuple[str, str]  # (name, path): re-registering a name with a new path is a new adapter


@dataclass(frozen=True)
class LoraLimits:
    """The slots a server allocates at start (`lora:` in its config); an adapter must fit them."""

    max_loras: int = 8
    max_lora_rank: int = 64
    target_modules: tuple[str, ...] = LORA_TARGETS


@dataclass(frozen=True)
class Grant:
    slot: int
    load: bool  # the slot does not hold the adapter yet: copy it in (and verify it) before use
    evicted: AdapterKey | None = None


class AdapterSlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.holder: dict[int, AdapterKey] = {}  # slot -> the adapter in it
        self.dropped: set[int] = set()  # slots of dropped adapters that requests still pin
        self.pins: dict[int, int] = {}  # slot -> requests using it
        self._used: dict[int, int] = {}  # slot -> when it was last pinned or released
        self._clock = 0

    def slot_of(self, key: AdapterKey) -> int | None:
        return next((slot for slot, held in self.holder.items() if held == key), None)

    def acquire(self, key: AdapterKey) -> Grant | None:
        """Pin a slot for one request of `key`; None when every slot is pinned by other adapters."""
        slot = self.slot_of(key)
        if slot is not None:
            self._pin(slot)
            return Grant(slot, load=False)
        free = [s for s in range(1, self.max_loras + 1) if s not in self.holder and s not in self.dropped]
        if free:
            slot, evicted = free[0], None
        else:
            idle = [s for s in self.holder if not self.pins.get(s)]
            if not idle:
                return None
            slot = min(idle, key=self._used.__getitem__)
            evicted = self.holder[slot]
        self.holder[slot] = key
        self._pin(slot)
        return Grant(slot, load=True, evicted=evicted)

    def release(self, slot: int) -> None:
        """A request that pinned `slot` has finished."""
        self.pins[slot] -= 1
        self._touch(slot)
        if not self.pins[slot]:
            self.dropped.discard(slot)

    def drop(self, key: AdapterKey) -> None:
        """Forget an adapter (one that failed to load or verify, or whose files changed): no later
        request finds it; its slot is free once no request pins it (a pinned slot keeps serving its
        requests until they finish)."""
        slot = self.slot_of(key)
        if slot is None:
            return
        del self.holder[slot]
        if self.pins.get(slot):
            self.dropped.add(slot)

    def report(self) -> dict[str, dict[str, int]]:
        """Loaded adapters by name: their slot and how many requests use them."""
        return {key[0]: {"slot": slot, "requests": self.pins.get(slot, 0)} for slot, key in sorted(self.holder.items())}

    def _pin(self, slot: int) -> None:
        self.pins[slot] = self.pins.get(slot, 0) + 1
        self._touch(slot)

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._used[slot] = self._clock
