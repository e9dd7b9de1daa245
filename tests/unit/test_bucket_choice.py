"""The bucket recommendation's optimiser against brute force on random histograms, and the cost of
a ladder (padding waste, graph hit rate) on hand-checked cases."""

from __future__ import annotations

import itertools
import random

import pytest

from policies.bucket_choice import best_buckets, ladder_cost


def padded_rows(histogram: dict[int, int], buckets) -> int:
    return sum(c * (min(b for b in buckets if b >= s) - s) for s, c in histogram.items())


def brute_force(histogram: dict[int, int], max_buckets: int) -> int:
    """The least padding of any ladder of at most max_buckets sizes in 1..max covering every size."""
    top = max(histogram)
    best = None
    for k in range(1, max_buckets + 1):
        for rest in itertools.combinations(range(1, top), k - 1):
            cost = padded_rows(histogram, (*rest, top))
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_optimum_equals_brute_force(seed):
    rng = random.Random(seed)
    top = rng.randint(1, 14)
    histogram = {s: rng.randint(1, 50) for s in rng.sample(range(1, top + 1), rng.randint(1, top))}
    n = rng.randint(1, 5)
    buckets = best_buckets(histogram, n)
    assert len(buckets) <= n and max(buckets) == max(histogram) and list(buckets) == sorted(set(buckets))
    assert padded_rows(histogram, buckets) == brute_force(histogram, n)


def test_enough_buckets_pad_nothing_and_one_bucket_is_the_largest_size():
    histogram = {1: 10, 3: 5, 7: 2, 30: 1}
    assert best_buckets(histogram, 4) == (1, 3, 7, 30)
    assert best_buckets(histogram, 10) == (1, 3, 7, 30)
    assert best_buckets(histogram, 1) == (30,)
    assert best_buckets({}, 3) == ()
    with pytest.raises(ValueError):
        best_buckets(histogram, 0)


def test_a_ladder_costs_its_padding_and_misses_what_it_does_not_cover():
    histogram = {1: 10, 3: 5, 12: 5}
    cost = ladder_cost(histogram, (2, 4, 8))
    assert cost.graph_hit_rate == pytest.approx(15 / 20)  # batches of 12 run eager
    assert cost.padding_waste == pytest.approx((10 * 1 + 5 * 1) / (10 * 2 + 5 * 4))
    assert ladder_cost(histogram, (1, 3, 12)).padding_waste == 0.0


def test_graph_memory_follows_the_measured_buckets():
    from policies.bucket_choice import graph_memory_mb

    measured = {1: 10.0, 8: 24.0, 32: 72.0}
    assert graph_memory_mb((1, 8), measured) == pytest.approx(34.0)
    assert graph_memory_mb((4,), measured) == pytest.approx(10 + 14 * 3 / 7)  # between 1 and 8
    assert graph_memory_mb((64,), measured) == pytest.approx(144.0)  # past the largest: by rows
    assert graph_memory_mb((4,), {}) is None
