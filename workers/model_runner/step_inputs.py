"""The inputs of one model call, built once from the scheduler's sequences and handed as they are to
the model runner (which copies them into its static buffers) and to the tensor-parallel step
channel (which sends them as one list of ints). Each per-row input is added here, once, instead of
in every place that builds, sends or unpacks a step: `adapters` is the LoRA slot each row reads
(0: none, see `lora.py`).

`pages` are the block-table edits (slot, index, page) the scheduler made since the last model call:
each rank applies them to its own cache's block table before the call, so every rank reads the
same pages without the table itself crossing the channel.
"""

from __future__ import annotations

from collections.abc import Sequence as Rows
from itertools import accumulate
from typing import NamedTuple, Protocol

import torch


class ScheduledRow(Protocol):
    """What a step reads of a scheduled sequence (the scheduler's `Sequence` is one): typed by its
    shape, so this module depends on nothing above it."""

    output_ids: list[int]
    slot: int
    adapter_slot: int
    prefill_start: int
    prefill_end: int

    @property
    def length(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...


def _on_device(rows: tuple[list[int], ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Equal-length int rows as device tensors, in one host-to-device copy."""
    return tuple(torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True))


class DecodeInputs(NamedTuple):
    """Per row: the token to decode, its position, its slot (block-table row) and its adapter slot."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    adapters: list[int]
    pages: list[int] = []

    @classmethod
    def of(cls, seqs: Rows[ScheduledRow], pages: Rows[int] = (), drawn: int = 0) -> DecodeInputs:
        """Each row decodes its sequence's last token; the first `drawn` rows decode the token the
        step before drew for them, which the host has not read yet (on the device; 0 here), one
        position further."""
        return cls(
            [0] * drawn + [s.output_ids[-1] for s in seqs[drawn:]],
            [s.length for s in seqs[:drawn]] + [s.length - 1 for s in seqs[drawn:]],
            [s.slot for s in seqs],
            [s.adapter_slot for s in seqs],
            list(pages),
        )

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def uses_lora(self) -> bool:
        return any(self.adapters)

    def to_ints(self) -> list[int]:
        return [*self.tokens, *self.positions, *self.slots, *self.adapters, *self.pages]

    @classmethod
    def from_ints(cls, rows: int, values: list[int]) -> DecodeInputs:
        return cls(*(values[i * rows : (i + 1) * rows] for i in range(4)), values[4 * rows :])

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """tokens, positions, slots, adapters as device tensors, in one host-to-device copy."""
        return _on_device(self[:4], device)


class PrefillInputs(NamedTuple):
    """Sequences packed end to end (a preempted one again with its output so far), each its chunk
    from `prefill_start` to `prefill_end` (the positions before it are in its pages: a cached prefix
    or earlier chunks): per token its id, position, slot and adapter slot; per sequence the count of
    its tokens here."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    adapters: list[int]
    lens: list[int]
    pages: list[int] = []

    @classmethod
    def of(cls, seqs: Rows[ScheduledRow], pages: Rows[int] = ()) -> PrefillInputs:
        """Each sequence's chunk: its positions prefill_start to prefill_end."""
        return cls(
            [t for s in seqs for t in s.token_ids[s.prefill_start : s.prefill_end]],
            [p for s in seqs for p in range(s.prefill_start, s.prefill_end)],
            [s.slot for s in seqs for _ in range(s.prefill_start, s.prefill_end)],
            [s.adapter_slot for s in seqs for _ in range(s.prefill_start, s.prefill_end)],
            [s.prefill_end - s.prefill_start for s in seqs],
            list(pages),
        )

    @classmethod
    def scratch(cls, lens: Rows[int], scratch_slot: int, context: int = 0) -> PrefillInputs:
        """Prompts of zeros written only to the cache's scratch slot (warm-up, gates), each after
        `context` positions as if those were cached."""
        n = sum(lens)
        positions = [p for m in lens for p in range(context, context + m)]
        return cls([0] * n, positions, [scratch_slot] * n, [0] * n, list(lens))

    @property
    def rows(self) -> int:
        return len(self.lens)

    @property
    def uses_lora(self) -> bool:
        return any(self.adapters)

    @property
    def context_lens(self) -> list[int]:
        """Per sequence, the positions before its first token here: K/V its pages already hold
        (a cached prefix), which its tokens attend to. Read off the positions, so it needs no
        room of its own in what crosses the tensor-parallel channel."""
        return [self.positions[i] for i in accumulate(self.lens[:-1], initial=0)]

    def to_ints(self) -> list[int]:
        return [*self.lens, *self.tokens, *self.positions, *self.slots, *self.adapters, *self.pages]

    @classmethod
    def from_ints(cls, rows: int, values: list[int]) -> PrefillInputs:
        lens, rest = values[:rows], values[rows:]
        n = sum(lens)
        return cls(*(rest[i * n : (i + 1) * n] for i in range(4)), lens, rest[4 * n :])

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """tokens, positions, slots, adapters as device tensors, in one host-to-device copy (lens
        stay on the host)."""
        return _on_device(self[:4], device)
