"""Tensor-parallel building blocks.

Every linear layer of the model is one of these, so a checkpoint is sharded at load time by the
layer that owns the weight. With world size 1 the collectives are no-ops and the layers are plain
linears; the tensor-parallel issue only has to supply a real `TPGroup`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks. Fused layers (QKV, gate/up) list their parts' sizes:
    each part is split separately so a rank holds its share of every part, side by side."""

    def __init__(
        self,
        in_features: int,
        part_sizes: Sequence[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gather_output = gather_output
        self.part_ranges = [tp.shard(size, "output features") for size in part_sizes]
        local = [stop - start for start, stop in self.part_ranges]
        self.part_offsets = [sum(local[:i]) for i in range(len(local))]
        self.local_sizes = local
        self.weight = nn.Parameter(torch.empty(sum(local), in_features, dtype=dtype, device=device), False)
        self.bias = nn.Parameter(torch.empty(sum(local), dtype=dtype, device=device), False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return self.tp.all_gather_last_dim(y) if self.gather_output else y

    def load(self, name: str, part: int, read: SliceReader) -> None:
        start, stop = self.part_ranges[part]
        lo = self.part_offsets[part]
        target = self.weight if name == "weight" else self.bias
        target.data[lo : lo + stop - start].copy_(read(0, start, stop))


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(F.linear(x, self.weight, bias))

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
