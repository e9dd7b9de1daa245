"""Where an engine's start-up time goes, phase by phase, for status pages and the READY log line.

A start that takes minutes is a deployment problem (replicas that autoscale late, restarts that
drop capacity); knowing which phase took it says what to fix: the checkpoint read (`load`), the KV
pool and static buffers (`allocate`), inductor (`compile`: the decode step's first calls when the
policy compiles), CUDA graph capture (`capture`), graph-vs-eager verification (`verify`) and the
first-token path's warm-up plus, without compile, the decode step's first calls (`warmup`). The
phases are disjoint stretches of the start, so they sum to at most `total_s`; the rest is glue.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping

PHASES = ("load", "allocate", "compile", "capture", "verify", "warmup")


class StartupClock:
    """Seconds per phase of one engine start; the clock started `load_s` before it was made (the
    checkpoint is read before the engine exists)."""

    def __init__(self, load_s: float = 0.0) -> None:
        self._start = time.perf_counter() - load_s
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.seconds["load"] = load_s
        self.total_s: float | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add({name: time.perf_counter() - t0})

    def add(self, seconds: Mapping[str, float]) -> None:
        """Seconds timed elsewhere (a graph runner's own phases)."""
        for name, s in seconds.items():
            self.seconds[name] += s

    def stop(self) -> None:
        self.total_s = time.perf_counter() - self._start

    def report(self) -> dict:
        """{"total_s", "phases": {phase: seconds}}; total_s is None until the start has ended."""
        return {"total_s": self.total_s, "phases": dict(self.seconds)}

    def summary(self) -> str:
        """One line for the log: the total and each phase that took any time."""
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.seconds.items() if s >= 0.05)
        return f"{self.total_s:.1f} s ({parts})"
