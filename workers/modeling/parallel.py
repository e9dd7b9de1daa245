"""Tensor-parallel building blocks.

Every linear layer of the model is one of these, so a checkpoint is sharded at load time by the
layer that owns the weight. With world size 1 the collectives are no-ops and the layers are plain
linears; the tensor-parallel issue only has to supply a real `TPGroup`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from workers.modeling.lora import LinearLora, LoraBatch

# Reads a slice of one checkpoint tensor: (dim, start, stop) -> tensor; dim None reads it whole.
SliceReader = Callable[[int | None, int, int], torch.Tensor]


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """The [start, stop) of this rank's equal share of `size` units of `what`."""
        if size % self.world_size:
            raise ValueError(f"{what}={size} is not divisible by tensor_parallel_size={self.world_size}")
        per = size // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def shard_padded(self, size: int) -> tuple[int, int]:
        """An equal share of `size` rounded up to a multiple of the world size; the last rank's
        range may run past `size` (those rows stay zero and are cut after gathering)."""
        per = -(-size // self.world_size)
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's KV heads: an equal share, or, with fewer KV heads than ranks, one head
        replicated across each group of world_size / num_kv_heads ranks."""
        if num_kv_heads % self.world_size == 0:
            return self.shard(num_kv_heads, "num_key_value_heads")
        if self.world_size % num_kv_heads == 0:
            head = self.rank * num_kv_heads // self.world_size
            return head, head + 1
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={self.world_size}: one must divide the other"
        )


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks. Fused layers (QKV, gate/up) list their parts' sizes:
    each part is split separately so a rank holds its share of every part, side by side."""

    def __init__(
        self,
        in_features: int,
        part_ranges: Sequence[tuple[int, int]],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        gather_output: bool = False,
    ) -> None:
        """part_ranges: for each fused part, the [start, stop) of its output rows this rank holds."""
        super().__init__()
        self.tp = tp
        self.gather_output = gather_output
        self.part_ranges = list(part_ranges)
        local = [stop - start for start, stop in self.part_ranges]
        self.part_offsets = [sum(local[:i]) for i in range(len(local))]
        self.weight = nn.Parameter(torch.zeros(sum(local), in_features, dtype=dtype, device=device), False)
        self.bias = nn.Parameter(torch.zeros(sum(local), dtype=dtype, device=device), False) if bias else None
        self.adapter: LinearLora | None = None  # LoRA slots, when enabled and this layer is adapted

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if lora is not None and self.adapter is not None:
            y = self.adapter.forward(x, lora, bias=True)
        else:
            y = F.linear(x, self.weight, self.bias)
        return self.tp.all_gather_last_dim(y) if self.gather_output else y

    def load(self, name: str, part: int, read: SliceReader) -> None:
        start, stop = self.part_ranges[part]
        rows = read(0, start, stop)  # shorter than stop - start where a padded range runs past the end
        lo = self.part_offsets[part]
        target = self.weight if name == "weight" else self.bias
        target.data[lo : lo + rows.shape[0]].copy_(rows)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial outputs are summed with one all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_range = tp.shard(in_features, "input features")
        local = self.in_range[1] - self.in_range[0]
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype, device=device), False)
        # The bias is added once, on rank 0, so the all-reduce does not multiply it.
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        self.adapter: LinearLora | None = None  # LoRA slots, when enabled and this layer is adapted

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """The adapters' partial delta joins this rank's partial output before the one all-reduce."""
        if lora is not None and self.adapter is not None:
            y = self.adapter.forward(x, lora, bias=self.tp.rank == 0)
        else:
            y = F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(y)

    def load(self, name: str, part: int, read: SliceReader) -> None:
        if name == "weight":
            self.weight.data.copy_(read(1, *self.in_range))
        else:
            self.bias.data.copy_(read(None, 0, 0))


class ReplicatedParameter(nn.Module):
    """A weight every rank holds whole (norms, the embedding table)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), False)

    def load(self, name: str, part: int, read: SliceReader) -> None:
        self.weight.data.copy_(read(None, 0, 0))
