"""Which full KV pages hold a cached prefix, and which of those nobody holds (evictable).

A page enters the index once its tokens are all written (or are being written by the step that
registers it), under its chain hash (`prefix_hash.py`). It stays addressable while sequences hold
it and after the last one lets go: then it is idle, and the pool takes it back only when it has no
free page left, least recently idle first. Pure bookkeeping: the block manager (`kv_blocks.py`)
owns reference counts and decides when a page goes idle or is taken back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    def __init__(self) -> None:
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first

    @property
    def num_cached(self) -> int:
        """Pages addressable by a hash, held or idle."""
        return len(self._hash_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def find(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest prefix of `hashes` cached: a chain breaks at its first miss."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def holds(self, page: int) -> bool:
        return page in self._hash_of

    def add(self, page: int, h: bytes) -> None:
        """Make a held page addressable by `h`. A hash another page already answers to is left
        there: this page stays private (its copy is freed like any page)."""
        if h not in self._page_of and page not in self._hash_of:
            self._page_of[h] = page
            self._hash_of[page] = h

    def park(self, page: int) -> None:
        """A cached page the last sequence let go: idle, the most recently used of them."""
        self._idle[page] = None

    def unpark(self, page: int) -> None:
        """An idle page a new sequence reuses: held again, so never evicted meanwhile."""
        del self._idle[page]

    def evict(self) -> int:
        """Forget the least recently idle page and return it for reuse (there must be one)."""
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        return page

    def clear(self) -> list[int]:
        """Forget every hash (the weights changed): returns the idle pages, now plain free pages.
        Held pages stay with their sequences, private from now on."""
        idle = list(self._idle)
        self._page_of.clear()
        self._hash_of.clear()
        self._idle.clear()
        return idle
