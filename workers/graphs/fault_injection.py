"""A fault for tests of the deployed server, armed only by the GRAPHSERVE_FAULT_FILE variable.

A test of the whole app (Ray Serve, replicas, engine child processes) cannot reach into an engine
to break one of its graphs. With the variable set, the engine child wraps every captured bucket's
replay: while the named file holds that bucket's size (e.g. "4"), the replay's first 8 logits are
raised by 1e4, the way a graph reading a stale buffer would drift (they then win every argmax).
The file is read at most every 50 ms, so a test switches the fault on and off while traffic runs.
Without the variable (as in production) nothing is wrapped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

VARIABLE = "GRAPHSERVE_FAULT_FILE"
READ_EVERY_S = 0.05


class FaultFile:
    """The bucket the file names (None: no file, or no number in it), re-read every READ_EVERY_S."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._bucket: int | None = None
        self._read_at = float("-inf")

    def bucket(self) -> int | None:
        now = time.monotonic()
        if now - self._read_at >= READ_EVERY_S:
            self._read_at = now
            try:
                self._bucket = int(self.path.read_text().strip())
            except (OSError, ValueError):
                self._bucket = None
        return self._bucket


def perturbed(replay: Callable[[], torch.Tensor], bucket: int, fault: FaultFile) -> Callable[[], torch.Tensor]:
    def replay_with_fault() -> torch.Tensor:
        out = replay()
        if fault.bucket() == bucket:
            out[:, :8] += 1e4
        return out

    return replay_with_fault


def arm_from_environment(replays: dict[int, Callable[[], torch.Tensor]]) -> None:
    """Wrap each bucket's replay in place when GRAPHSERVE_FAULT_FILE is set."""
    path = os.environ.get(VARIABLE)
    if not path:
        return
    fault = FaultFile(Path(path))
    for bucket, replay in replays.items():
        replays[bucket] = perturbed(replay, bucket, fault)
