"""The inputs of one model call, built once from the scheduler's sequences and handed as they are to
the graph runner (which copies them into its static buffers) and to the tensor-parallel step
channel (which sends them as one list of ints). A new per-row input (a block table, an adapter id)
is added here, once, instead of in every place that builds, sends or unpacks a step.
"""

from __future__ import annotations

from collections.abc import Sequence as Rows
from typing import NamedTuple

import torch

from workers.scheduler import Sequence


class DecodeInputs(NamedTuple):
    """Per row: the token to decode, its position and its KV slot."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]

    @classmethod
    def of(cls, seqs: Rows[Sequence]) -> DecodeInputs:
        return cls([s.output_ids[-1] for s in seqs], [s.length - 1 for s in seqs], [s.slot for s in seqs])

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def to_ints(self) -> list[int]:
        return [*self.tokens, *self.positions, *self.slots]

    @classmethod
    def from_ints(cls, rows: int, values: list[int]) -> DecodeInputs:
        return cls(values[:rows], values[rows : 2 * rows], values[2 * rows : 3 * rows])

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, positions, slots as device tensors, in one host-to-device copy."""
        return tuple(torch.tensor(self, dtype=torch.int64).to(device, non_blocking=True))


class PrefillInputs(NamedTuple):
    """Whole prompts packed end to end: per token its id, position and KV slot; per prompt its length."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    lens: list[int]

    @classmethod
    def of(cls, seqs: Rows[Sequence]) -> PrefillInputs:
        return cls(
            [t for s in seqs for t in s.prompt_ids],
            [p for s in seqs for p in range(len(s.prompt_ids))],
            [s.slot for s in seqs for _ in s.prompt_ids],
            [len(s.prompt_ids) for s in seqs],
        )

    @property
    def rows(self) -> int:
        return len(self.lens)

    def to_ints(self) -> list[int]:
        return [*self.tokens, *self.positions, *self.slots, *self.lens]

    @classmethod
    def from_ints(cls, rows: int, values: list[int]) -> PrefillInputs:
        n = (len(values) - rows) // 3
        return cls(values[:n], values[n : 2 * n], values[2 * n : 3 * n], values[3 * n :])

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, positions, slots as device tensors, in one host-to-device copy (lens stay on the host)."""
        return tuple(torch.tensor(self[:3], dtype=torch.int64).to(device, non_blocking=True))
