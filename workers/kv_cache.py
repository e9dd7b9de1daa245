"""The KV cache: fixed slots allocated once, updated in place.

Shape per layer: (num_slots + 1, kv_heads, max_model_len, head_dim). A sequence owns one slot for its
whole life; its length lives with the scheduler. The extra last slot is scratch: rows that exist only
to pad a batch write there, so they can never touch a real sequence's keys and values.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("graphserve::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
    k: torch.Tensor, v: torch.Tensor,
) -> None:  # fmt: skip
    """One op that writes in place: under torch.compile a plain index_put_ on the cache (a graph input)
    is functionalized into copies of the whole cache; a custom op that declares its mutation is not."""
    k_cache[slot_ids, :, positions] = k
    v_cache[slot_ids, :, positions] = v


@kv_write.register_fake
def _(k_cache, v_cache, slot_ids, positions, k, v) -> None:
    return None


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_model_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_slots + 1, num_kv_heads, max_model_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.max_model_len = max_model_len

    def write(
        self, layer: int, slot_ids: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v of shape (tokens, kv_heads, head_dim) at (slot, position) for each token."""
        kv_write(self.k[layer], self.v[layer], slot_ids, positions, k, v)

    def read(self, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given slots: (rows, kv_heads, max_model_len, head_dim) each."""
        return self.k[layer].index_select(0, slot_ids), self.v[layer].index_select(0, slot_ids)
