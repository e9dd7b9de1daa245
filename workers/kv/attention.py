"""Decode attention backends over the paged KV cache. Each declares how far it can be captured.

- `triton`: Triton kernels over the block table (`paged_attention.py`) that read only each row's live
  keys, in work items of about equal size whatever the mix of lengths; the step's work plan is made
  on the device once (`prepare`) and read by every layer. Fixed launch shapes and no host sync, so
  the whole step is captured (`full`). CUDA.
- `sdpa`: gathers each row's whole block table (max_model_len positions) and masks by length. Fixed
  shapes, no host sync (`full`), but its cost follows max_model_len, not the live context. Runs
  anywhere: the CPU path, and the reference the kernel is checked against.
- `sdpa_varlen`: gathers pages only up to the longest row of the batch; that length is read on the
  host each step, so attention itself cannot be captured and runs eager between captured pieces
  (`piecewise`).
`auto` picks `triton` where it can run and `sdpa` elsewhere.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from workers.kv import paged_attention
from workers.kv.kv_cache import KVCache, pages_needed

GraphSupport = Literal["full", "piecewise", "none"]


def visible_mask(num_keys: int, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """(rows, 1, 1, num_keys): key position j is visible to a row at position p when j <= p (and
    within the sliding window, if any)."""
    kv_index = torch.arange(num_keys, device=positions.device)
    visible = kv_index[None, :] <= positions[:, None]
    if window:
        visible &= kv_index[None, :] > positions[:, None] - window
    return visible[:, None, None, :]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows, kv_heads = keys.shape[0], keys.shape[1]
    # GQA without copying K/V: the query heads sharing one KV head become its query rows.
    out = F.scaled_dot_product_attention(q.view(rows, kv_heads, -1, q.shape[-1]), keys, values, attn_mask=mask)
    return out.reshape(rows, -1)


class TritonDecode:
    name = "triton"
    graph_support: GraphSupport = "full"

    def prepare(self, cache: KVCache, positions: torch.Tensor, window: int | None) -> paged_attention.Plan:
        """The work plan over the live lengths (positions + 1), the window already applied: once a
        step rather than once a layer, since every layer reads the same lengths."""
        kv_heads, head_dim = cache.k.shape[-2:]
        return paged_attention.paged_decode_plan(positions + 1, window, kv_heads, head_dim)

    def __call__(self, q, k_pages, v_pages, cache: KVCache, slot_ids, plan, window: int | None) -> torch.Tensor:
        return paged_attention.paged_decode(q, k_pages, v_pages, cache.block_table, slot_ids, *plan)


class SdpaDecode:
    name = "sdpa"
    graph_support: GraphSupport = "full"

    def prepare(self, cache: KVCache, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        return visible_mask(cache.max_pages * cache.page_size, positions, window)

    def __call__(self, q, k_pages, v_pages, cache: KVCache, slot_ids, mask, window: int | None) -> torch.Tensor:
        return _attend(q, *cache.gather(k_pages, v_pages, slot_ids, cache.max_pages), mask)


class SdpaVarlenDecode:
    name = "sdpa_varlen"
    graph_support: GraphSupport = "piecewise"

    def prepare(self, cache: KVCache, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        longest = int(positions.max()) + 1  # host sync: the longest row decides how many pages are read
        return visible_mask(pages_needed(longest, cache.page_size) * cache.page_size, positions, window)

    def __call__(self, q, k_pages, v_pages, cache: KVCache, slot_ids, mask, window: int | None) -> torch.Tensor:
        return _attend(q, *cache.gather(k_pages, v_pages, slot_ids, mask.shape[-1] // cache.page_size), mask)


BACKENDS = {b.name: b for b in (TritonDecode, SdpaDecode, SdpaVarlenDecode)}


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` -> the fastest backend this device runs; any other name as it is."""
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" and paged_attention.available() else "sdpa"


def make_backend(name: str, device: torch.device):
    name = resolve_backend_name(name, device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(BACKENDS)}")
    if name == "triton" and not (device.type == "cuda" and paged_attention.available()):
        raise ValueError("attention backend 'triton' needs CUDA and triton; use 'auto' or 'sdpa'")
    return BACKENDS[name]()
