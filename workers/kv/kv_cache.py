"""The paged KV cache: one pool of fixed-size pages per layer, allocated once and never moved.

Shape per layer: (num_pages, page_size, kv_heads, head_dim). Page 0 is scratch: rows that exist only
to pad a batch write there, so they never touch a real sequence's keys and values. Which pages a
sequence holds is decided by the scheduler's block manager (`policies/kv_blocks.py`); this class
keeps the device copy of those decisions, the block table: one row per sequence slot (num_slots
rows, plus a last scratch row whose entries are all page 0), `max_pages` entries a row. Graphs read
the table at a fixed address, so it changes in place, by edits: a sequence gains one entry per
page_size tokens, so a step sends a few (slot, index, page) triples instead of the whole table.
"""

from __future__ import annotations

import torch

SCRATCH_PAGE = 0


@torch.library.custom_op("graphserve::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """One op that writes in place: under torch.compile a plain index_put_ on the cache (a graph input)
    is functionalized into copies of the whole cache; a custom op that declares its mutation is not."""
    k_cache.view(-1, *k_cache.shape[2:])[index] = k
    v_cache.view(-1, *v_cache.shape[2:])[index] = v


@kv_write.register_fake
def _(k_cache, v_cache, index, k, v) -> None:
    return None


def pages_needed(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_slots: int,
        max_model_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.max_model_len = max_model_len
        self.max_pages = pages_needed(max_model_len, page_size)
        self.block_table = torch.full((num_slots + 1, self.max_pages), SCRATCH_PAGE, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def clear(self) -> None:
        """Zero every page, in place (the graphs keep their addresses); only with no live sequence.
        A model that failed its gate may have left NaN in pages, and attention multiplies the
        values at masked positions by 0, which keeps a NaN."""
        self.k.zero_()
        self.v.zero_()

    def set_pages(self, edits: list[int]) -> None:
        """Apply block-table edits, a flat list of (slot, index, page) triples, in one copy."""
        if edits:
            edits = torch.tensor(edits, dtype=torch.int64).to(self.block_table.device, non_blocking=True)
            slot, index, page = edits.view(-1, 3).T
            self.block_table[slot, index] = page.to(torch.int32)

    def write_index(self, slot_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Where each (slot, position) lives in the flattened pool: page * page_size + offset."""
        pages = self.block_table[slot_ids, positions // self.page_size].long()
        return pages * self.page_size + positions % self.page_size

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V pools, (num_pages, page_size, kv_heads, head_dim) views each."""
        return self.k[layer], self.v[layer]

    def read(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of shape (len(index), kv_heads, head_dim) stored at these flattened pool positions."""
        return self.k[layer].flatten(0, 1)[index], self.v[layer].flatten(0, 1)[index]

    def gather(
        self, k_pages: torch.Tensor, v_pages: torch.Tensor, slot_ids: torch.Tensor, num_pages: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the slots' first num_pages pages in one layer's pools, position-ordered:
        (rows, kv_heads, num_pages * page_size, head_dim) each (for attention without paged kernels)."""
        pages = self.block_table[slot_ids, :num_pages].long()
        rows = slot_ids.shape[0]

        def one(pool: torch.Tensor) -> torch.Tensor:
            return pool[pages].view(rows, num_pages * self.page_size, *pool.shape[2:]).transpose(1, 2)

        return one(k_pages), one(v_pages)
