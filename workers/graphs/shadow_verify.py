"""Online shadow verification: now and then a replayed decode step is recomputed eagerly on the same
static inputs and the two must agree bit for bit.

Startup verification (`GraphRunner.verify`) checks each graph once, on a probe; a graph can still go
wrong later (a buffer another allocation overwrote, a driver fault, a capture that only some shapes
of live traffic expose). Every `every_n`-th replay of a runner is checked: the same step function the
graph was captured from (compiled or not) runs on the inputs the replay just read. It writes the
same K/V at the same positions as the replay did, so a correct graph leaves the cache as it was, and
a wrong one has its KV writes replaced by the right ones. The caller withdraws a bucket that
mismatches (`verify_mismatch`) and uses the eager logits for that step.
"""

from __future__ import annotations

import math
from collections import Counter

import torch


class ShadowVerifier:
    def __init__(self, every_n: int) -> None:
        self.every_n = every_n
        self.replays = 0
        self.results: Counter[tuple[str, str]] = Counter()  # (bucket_id, "match" | "mismatch") -> checks
        self.last_mismatch: str | None = None

    def due(self) -> bool:
        """Count one replay; whether this one is checked (the same decision on every TP rank: each
        counts its own replays, which are the same)."""
        self.replays += 1
        return self.every_n > 0 and self.replays % self.every_n == 0

    def compare(self, bucket_id: str, replayed: torch.Tensor, eager: torch.Tensor) -> str | None:
        """Record one check of `rows` live rows; the mismatch's description, or None when bit-equal."""
        if torch.equal(replayed, eager):
            self.results[(bucket_id, "match")] += 1
            return None
        diff = (replayed.float() - eager.float()).abs().max().item()
        shown = f"{diff:.3g}" if math.isfinite(diff) else "non-finite"
        detail = f"{bucket_id}: max |graph - eager| = {shown} over {replayed.shape[0]} rows at replay {self.replays}"
        self.results[(bucket_id, "mismatch")] += 1
        self.last_mismatch = detail
        return detail

    def report(self) -> dict:
        return {
            "every_n_steps": self.every_n,
            "checks": sum(self.results.values()),
            "mismatches": sum(n for (_, result), n in self.results.items() if result == "mismatch"),
            "last_mismatch": self.last_mismatch,
            "by_bucket": [{"bucket_id": b, "result": r, "count": n} for (b, r), n in sorted(self.results.items())],
        }
