"""Decode attention backends. Each declares how far it can be captured in a CUDA graph.

- `sdpa`: gathers each row's slot and masks by length over the full max_model_len. Fixed shapes and
  no host sync, so the whole decode step, attention included, can be captured (support `full`).
- `sdpa_varlen`: reads keys only up to the longest sequence in the batch. Less memory traffic for
  short sequences, but the length is read on the host each step, so attention itself cannot be
  captured: it runs eager between captured pieces (support `piecewise`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

GraphSupport = Literal["full", "piecewise", "none"]


def visible_mask(kv_index: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """(rows, 1, 1, len): key position j is visible to a row at position p when j <= p (and within
    the sliding window, if any)."""
    visible = kv_index[None, :] <= positions[:, None]
    if window:
        visible &= kv_index[None, :] > positions[:, None] - window
    return visible[:, None, None, :]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows, kv_heads = keys.shape[0], keys.shape[1]
    # GQA without copying K/V: the query heads sharing one KV head become its query rows.
    out = F.scaled_dot_product_attention(q.view(rows, kv_heads, -1, q.shape[-1]), keys, values, attn_mask=mask)
    return out.reshape(rows, -1)


class SdpaDecode:
    name = "sdpa"
    graph_support: GraphSupport = "full"

    def prepare(self, kv_index: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        return visible_mask(kv_index, positions, window)

    def __call__(self, q, k_layer, v_layer, slot_ids, meta) -> torch.Tensor:
        return _attend(q, k_layer.index_select(0, slot_ids), v_layer.index_select(0, slot_ids), meta)


class SdpaVarlenDecode:
    name = "sdpa_varlen"
    graph_support: GraphSupport = "piecewise"

    def prepare(self, kv_index: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        n = int(positions.max()) + 1  # host sync: the longest row decides how far keys are read
        return visible_mask(kv_index[:n], positions, window)

    def __call__(self, q, k_layer, v_layer, slot_ids, meta) -> torch.Tensor:
        n = meta.shape[-1]
        keys = k_layer[:, :, :n].index_select(0, slot_ids)
        values = v_layer[:, :, :n].index_select(0, slot_ids)
        return _attend(q, keys, values, meta[..., :n])


BACKENDS = {b.name: b for b in (SdpaDecode, SdpaVarlenDecode)}


def make_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]()
