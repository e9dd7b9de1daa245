"""Bookkeeping of a paged KV cache: which pages of the pool each sequence holds, which are free, and
whom to preempt when a decode step needs pages the pool no longer has.

The pool is `num_pages` pages of `page_size` token positions each, allocated once on the device
(graphs hold its address); this module only decides page numbers, so every rank of a tensor-parallel
group running it on the same calls reaches the same tables. The first `reserved` pages are never
handed out (the scratch page padding rows write to). Preemption takes the newest sequences first, as
vLLM does: the oldest keep making progress, and a preempted sequence keeps its tokens and is
re-prefilled when pages are free again.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a request needs now."""


@dataclass
class _Held:
    pages: list[int] = field(default_factory=list)
    tokens: int = 0  # positions written (or about to be) in these pages


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, reserved: int = 1) -> None:
        if page_size < 1 or num_pages <= reserved or reserved < 0:
            raise ValueError(f"{num_pages} pages of {page_size} tokens, {reserved} reserved: no room for a sequence")
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserved = reserved
        self._free = list(range(reserved, num_pages))  # a heap: the lowest free page is handed out first
        self._held: dict[str, _Held] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Token positions the pool can hold for sequences (reserved pages excluded)."""
        return (self.num_pages - self.reserved) * self.page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.pages_for(tokens) <= self.num_free

    def allocate(self, seq_id: str, tokens: int) -> list[int]:
        """Pages for a new sequence's first `tokens` positions (its prompt); its block table."""
        if seq_id in self._held:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        needed = self.pages_for(tokens)
        if needed > self.num_free:
            raise OutOfPages(f"{tokens} tokens need {needed} pages; {self.num_free} free")
        self._held[seq_id] = _Held([heapq.heappop(self._free) for _ in range(needed)], tokens)
        return list(self._held[seq_id].pages)

    def needs_page(self, seq_id: str) -> bool:
        """Whether the sequence's next position starts a page it does not hold yet."""
        return self._needs(self._held[seq_id])

    def _needs(self, held: _Held) -> bool:
        return held.tokens == len(held.pages) * self.page_size

    def append(self, seq_id: str) -> None:
        """Room for one more position of the sequence (a new page when it crosses into one)."""
        if self.needs_page(seq_id):
            if not self._free:
                raise OutOfPages(f"sequence {seq_id!r} needs a page; none free")
            self._held[seq_id].pages.append(heapq.heappop(self._free))
        self._held[seq_id].tokens += 1

    def free(self, seq_id: str) -> None:
        """Give a finished or preempted sequence's pages back (a sequence holding none is ignored)."""
        held = self._held.pop(seq_id, None)
        if held is not None:
            for page in held.pages:
                heapq.heappush(self._free, page)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._held[seq_id].pages)

    def tokens(self, seq_id: str) -> int:
        return self._held[seq_id].tokens

    def slot(self, seq_id: str, position: int) -> int:
        """The pool index (page * page_size + offset) of one of the sequence's positions."""
        page, offset = divmod(position, self.page_size)
        return self._held[seq_id].pages[page] * self.page_size + offset

    def reserve_step(self, running: Sequence[str]) -> tuple[list[str], list[str]]:
        """Room for one more position of every running sequence (given oldest first), preempting the
        newest while the pool cannot supply the pages this step needs: their pages are freed. Returns
        (the preempted, newest first, to be re-queued; the kept sequences that got a new page, whose
        block tables grew). One pass over the batch: this runs every decode step."""
        kept = list(running)
        needing = {s for s in kept if self._needs(self._held[s])}
        preempted: list[str] = []
        while len(needing) > self.num_free:
            victim = kept.pop()
            needing.discard(victim)
            self.free(victim)
            preempted.append(victim)
        grown = []
        for seq_id in kept:
            held = self._held[seq_id]
            if seq_id in needing:
                held.pages.append(heapq.heappop(self._free))
                grown.append(seq_id)
            held.tokens += 1
        return preempted, grown
