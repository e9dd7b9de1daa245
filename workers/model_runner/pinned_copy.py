"""Filling a device tensor that captured graphs read at a fixed address: staged in pinned host memory
and sent in one copy that does not wait for the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PinnedCopy:
    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self._host = torch.zeros(target.shape, dtype=target.dtype, pin_memory=target.is_cuda)
        self._copied = torch.cuda.Event() if target.is_cuda else None

    def fill(self, values: Sequence[Sequence[int]], width: int, pad: Sequence[int]) -> None:
        """Row i of the target's first `width` columns gets values[i] (all of one length), then
        pad[i] in the columns after it."""
        n = len(values[0])
        if self._copied is not None:  # a step may fill twice: the last copy must have read the host rows
            self._copied.synchronize()
        host = self._host[:, :width]
        host[:, :n] = torch.tensor(values)
        host[:, n:] = torch.tensor(pad)[:, None]
        self.target[:, :width].copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
