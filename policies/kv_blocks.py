"""Bookkeeping of a paged KV cache: which pages of the pool each sequence holds, which are free, and
whom to preempt when a decode step needs pages the pool no longer has.

The pool is `num_pages` pages of `page_size` token positions each, allocated once on the device
(graphs hold its address); this module only decides page numbers, so every rank of a tensor-parallel
group running it on the same calls reaches the same tables. The first `reserved` pages are never
handed out (the scratch page padding rows write to). Preemption takes the newest sequences first, as
vLLM does: the oldest keep making progress, and a preempted sequence keeps its tokens and is
re-prefilled when pages are free again.

Prefix caching: a full page can be held by several sequences at once (a reference count each), when
their tokens up to its end hash alike (`prefix_hash.py`); a new sequence reuses every cached full
page of its prefix and computes only the rest. Only full pages are shared and nobody writes a full
page again, so no page is written while another sequence reads it: a sequence's partial last page
is always its own. The page holding a new sequence's last token is never reused, so its prefill
computes at least that page (and the logits of its last token). A cached page nobody holds stays
addressable (`prefix_cache.py`) until the pool needs it: free pages go first, then the least
recently released cached ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from policies.prefix_cache import PrefixCache


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a request needs now."""


@dataclass
class _Held:
    pages: list[int] = field(default_factory=list)
    tokens: int = 0  # positions written (or about to be) in these pages
    cached: int = 0  # leading pages reused from the prefix cache when it was allocated


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, reserved: int = 1) -> None:
        if page_size < 1 or num_pages <= reserved or reserved < 0:
            raise ValueError(f"{num_pages} pages of {page_size} tokens, {reserved} reserved: no room for a sequence")
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserved = reserved
        self._free = list(range(reserved, num_pages))  # a heap: the lowest free page is handed out first
        self._held: dict[str, _Held] = {}
        self._refs: dict[int, int] = {}  # page -> sequences holding it (absent: none)
        self.prefix = PrefixCache()

    @property
    def num_free(self) -> int:
        """Pages a sequence can be given now: free ones and idle cached ones (evicted on demand)."""
        return len(self._free) + self.prefix.num_idle

    @property
    def capacity_tokens(self) -> int:
        """Token positions the pool can hold for sequences (reserved pages excluded)."""
        return (self.num_pages - self.reserved) * self.page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.pages_for(tokens) <= self.num_free

    def cached_prefix(self, tokens: int, hashes: Sequence[bytes]) -> list[int]:
        """The cached pages a new sequence of `tokens` positions would reuse, given its full pages'
        chain hashes: the longest cached prefix, short of the page of its last token (computed
        again when cached, so that its prefill has that token's logits)."""
        return self.prefix.find(hashes[: (tokens - 1) // self.page_size])

    def pages_taken(self, hits: Sequence[int], tokens: int) -> int:
        """What a sequence of `tokens` positions reusing `hits` takes from `num_free`: its new
        pages, and the hits nobody holds now (they stop being evictable)."""
        return self.pages_for(tokens) - len(hits) + sum(self.prefix.is_idle(p) for p in hits)

    def allocate(self, seq_id: str, tokens: int, hashes: Sequence[bytes] = (), written: int | None = None) -> list[int]:
        """Pages for a new sequence's first `tokens` positions (its prompt); its block table.
        `hashes`: the chain hashes of its full pages (none: nothing reused or cached). Its cached
        prefix is reused; the full pages among its first `written` positions (default: all)
        become cached (its prefill, this step, writes them before any later reader's attention
        reads them); a chunked prefill caches the rest with `cache_page` as its chunks go in."""
        if seq_id in self._held:
            raise ValueError(f"sequence {seq_id!r} already holds pages")
        hits = self.cached_prefix(tokens, hashes)
        if self.pages_taken(hits, tokens) > self.num_free:
            raise OutOfPages(
                f"{tokens} tokens need {self.pages_for(tokens) - len(hits)} new pages; {self.num_free} free"
            )
        for page in hits:
            self._ref(page)
        pages = hits + [self._take() for _ in range(self.pages_for(tokens) - len(hits))]
        self._held[seq_id] = _Held(pages, tokens, len(hits))
        written = tokens if written is None else written
        for index in range(len(hits), min(len(hashes), written // self.page_size)):
            self.prefix.add(pages[index], hashes[index])
        return list(pages)

    def cache_page(self, seq_id: str, index: int, h: bytes) -> None:
        """Make the sequence's page `index`, full as of this step, addressable by its hash `h`."""
        self.prefix.add(self._held[seq_id].pages[index], h)

    def cached_tokens(self, seq_id: str) -> int:
        """Positions of the sequence reused from the prefix cache when it was allocated."""
        return self._held[seq_id].cached * self.page_size

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (new weights make their K/V wrong): idle pages become free,
        held ones stay with their sequences and are freed as private pages."""
        for page in self.prefix.clear():
            heapq.heappush(self._free, page)

    def needs_page(self, seq_id: str) -> bool:
        """Whether the sequence's next position starts a page it does not hold yet."""
        return self._needs(self._held[seq_id])

    def _needs(self, held: _Held) -> bool:
        return held.tokens == len(held.pages) * self.page_size

    def _take(self) -> int:
        """A page for a sequence: the lowest free one, else the least recently idle cached one."""
        page = heapq.heappop(self._free) if self._free else self.prefix.evict()
        self._refs[page] = 1
        return page

    def _ref(self, page: int) -> None:
        if self.prefix.is_idle(page):
            self.prefix.unpark(page)
        self._refs[page] = self._refs.get(page, 0) + 1

    def append(self, seq_id: str) -> None:
        """Room for one more position of the sequence (a new page when it crosses into one)."""
        if self.needs_page(seq_id):
            if not self.num_free:
                raise OutOfPages(f"sequence {seq_id!r} needs a page; none free")
            self._held[seq_id].pages.append(self._take())
        self._held[seq_id].tokens += 1

    def free(self, seq_id: str) -> None:
        """Give a finished or preempted sequence's pages back (a sequence holding none is ignored).
        A cached page goes idle once nobody holds it, its sequence's last pages before its first,
        so eviction takes a chain's tail (which fewer prompts share) before its head."""
        held = self._held.pop(seq_id, None)
        if held is None:
            return
        for page in reversed(held.pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            if self.prefix.holds(page):
                self.prefix.park(page)
            else:
                heapq.heappush(self._free, page)

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._held[seq_id].pages)

    def tokens(self, seq_id: str) -> int:
        return self._held[seq_id].tokens

    def slot(self, seq_id: str, position: int) -> int:
        """The pool index (page * page_size + offset) of one of the sequence's positions."""
        page, offset = divmod(position, self.page_size)
        return self._held[seq_id].pages[page] * self.page_size + offset

    def reserve_step(self, running: Sequence[str], prefilling: Collection[str] = ()) -> tuple[list[str], list[str]]:
        """Room for one more position of every running sequence (given oldest first) but those still
        `prefilling` (they hold their prompt's pages and do not grow this step), preempting the
        newest while the pool cannot supply the pages this step needs: their pages are freed. Returns
        (the preempted, newest first, to be re-queued; the kept sequences that got a new page, whose
        block tables grew). One pass over the batch: this runs every decode step."""
        kept = list(running)
        needing = {s for s in kept if s not in prefilling and self._needs(self._held[s])}
        preempted: list[str] = []
        while len(needing) > self.num_free:
            victim = kept.pop()
            needing.discard(victim)
            self.free(victim)
            preempted.append(victim)
        grown = []
        for seq_id in kept:
            if seq_id in prefilling:
                continue
            held = self._held[seq_id]
            if seq_id in needing:
                held.pages.append(self._take())
                grown.append(seq_id)
            held.tokens += 1
        return preempted, grown
