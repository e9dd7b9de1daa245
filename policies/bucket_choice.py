"""Bucket sizes from the live decode batch-size distribution, not powers of two by habit.

A decode step of b rows replays the smallest bucket >= b and pads the rest; a step larger than every
bucket runs eager. Given how often each batch size ran, `best_buckets` picks at most n sizes that
cover every size seen with the fewest padded rows, exactly: an optimal bucket always sits on a size
that was seen (moving it down to the largest size it covers only removes padding), so a dynamic
program over the seen sizes (k buckets, the last at the j-th size) finds it in O(n m^2) for m sizes.
Pure: unit-tested against brute force.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LadderCost:
    buckets: tuple[int, ...]
    padding_waste: float  # padded rows / rows replayed (real + padded), over the steps a bucket covers
    graph_hit_rate: float  # steps some bucket covers / all steps


def ladder_cost(histogram: Mapping[int, int], buckets: Sequence[int]) -> LadderCost:
    """What `buckets` would have cost on `histogram` ({batch size: steps})."""
    ladder = tuple(sorted(set(buckets)))
    steps = rows = padding = covered = 0
    for size, count in histogram.items():
        steps += count
        bucket = next((b for b in ladder if b >= size), None)
        if bucket is None:
            continue
        covered += count
        rows += count * size
        padding += count * (bucket - size)
    replayed = rows + padding
    return LadderCost(ladder, padding / replayed if replayed else 0.0, covered / steps if steps else 0.0)


def best_buckets(histogram: Mapping[int, int], max_buckets: int) -> tuple[int, ...]:
    """At most max_buckets sizes covering every size in `histogram` with the fewest padded rows
    (ties: the fewer buckets, then the smaller sizes)."""
    if max_buckets < 1:
        raise ValueError("max_buckets must be at least 1")
    sizes = sorted(s for s, c in histogram.items() if c > 0)
    if not sizes:
        return ()
    counts = [histogram[s] for s in sizes]
    m = len(sizes)
    # prefix sums of steps and of rows: the padding of sizes i..j-1 replayed at sizes[j-1]
    steps, rows = [0], [0]
    for s, c in zip(sizes, counts, strict=True):
        steps.append(steps[-1] + c)
        rows.append(rows[-1] + c * s)

    def padding(i: int, j: int) -> int:
        return sizes[j - 1] * (steps[j] - steps[i]) - (rows[j] - rows[i])

    inf = float("inf")
    # best[j]: (padding, ladder) covering sizes[:j] with the last bucket at sizes[j-1], for k buckets
    best: list[tuple[float, tuple[int, ...]]] = [(inf, ())] * (m + 1)
    best[0] = (0, ())
    answer = (inf, ())
    for _ in range(min(max_buckets, m)):
        nxt: list[tuple[float, tuple[int, ...]]] = [(inf, ())] * (m + 1)
        for j in range(1, m + 1):
            for i in range(j):
                if best[i][0] == inf:
                    continue
                candidate = (best[i][0] + padding(i, j), (*best[i][1], sizes[j - 1]))
                if candidate[0] < nxt[j][0]:
                    nxt[j] = candidate
        best = nxt
        if best[m][0] < answer[0]:
            answer = best[m]
    return answer[1]


def graph_memory_mb(buckets: Sequence[int], measured: Mapping[int, float]) -> float | None:
    """The graph memory a ladder would take, from the memory measured per captured bucket: a size
    measured is taken as is, one between two measured sizes interpolated, one outside scaled with
    the nearest measured size by rows. None without a measurement (no graphs, e.g. on CPU)."""
    points = sorted((s, m) for s, m in measured.items() if m and m > 0)
    if not points:
        return None
    total = 0.0
    for size in buckets:
        below = [p for p in points if p[0] <= size]
        above = [p for p in points if p[0] >= size]
        if below and above:
            (s0, m0), (s1, m1) = below[-1], above[0]
            total += m0 if s1 == s0 else m0 + (m1 - m0) * (size - s0) / (s1 - s0)
        else:
            s0, m0 = below[-1] if below else above[0]
            total += m0 * size / s0
    return total
