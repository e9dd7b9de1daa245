"""Test helpers for the paged KV cache: give every slot pages of its own (scattered, as a running
server leaves them) and read a slot's K/V back in position order."""

from __future__ import annotations

import torch

from workers.kv.kv_cache import KVCache


def page_edits(cache: KVCache, seed: int = 0) -> list[int]:
    """Block-table edits that give every slot max_pages pages, drawn at random from the pool (never
    the scratch page)."""
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randperm(cache.num_pages - 1, generator=g) + 1).tolist()
    need = cache.num_slots * cache.max_pages
    assert len(pool) >= need, f"the pool has {len(pool)} pages; {need} needed"
    return [
        v for s in range(cache.num_slots) for i in range(cache.max_pages) for v in (s, i, pool[s * cache.max_pages + i])
    ]


def assign_pages(cache: KVCache, seed: int = 0) -> None:
    cache.set_pages(page_edits(cache, seed))


def slot_positions(cache: KVCache, slot: int, n: int) -> torch.Tensor:
    """Flat pool indices of positions 0..n-1 of a slot."""
    positions = torch.arange(n)
    return cache.write_index(torch.full((n,), slot), positions)


def slot_kv(cache: KVCache, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a slot's first n positions: (layers, n, kv_heads, head_dim) each."""
    index = slot_positions(cache, slot, n)
    return tuple(t.flatten(1, 2)[:, index] for t in (cache.k, cache.v))


def poison(cache: KVCache, keep: dict[int, int], seed: int = 99) -> None:
    """Fill the pool with huge random values everywhere except positions [0, keep[slot]) of each slot
    in `keep`: any read outside a row's own pages and length then wrecks its output."""
    g = torch.Generator().manual_seed(seed)
    kept = {slot: slot_kv(cache, slot, n) for slot, n in keep.items()}
    for t in (cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=g) * 1e4)
    for slot, (k, v) in kept.items():
        index = slot_positions(cache, slot, k.shape[1])
        cache.k.flatten(1, 2)[:, index] = k
        cache.v.flatten(1, 2)[:, index] = v
