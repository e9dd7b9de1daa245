"""The rules that pick how a prefill of a few tokens runs, against the H200 measurements they came
from: rows of the decode step (`bench/results/prefill_rows_h200.md`), and the paged decode kernel
for a prefill's attention over cached contexts (`bench/results/cached_prefill_attention_h200.md`)."""

from __future__ import annotations

import pytest

from policies.cached_prefill import paged_prefill_pays, prefill_as_decode_rows


@pytest.mark.parametrize(
    ("lens", "contexts", "rows"),
    [
        ([1], [0], True),  # measured 0.75x (1B) and 0.85x (8B) the prefill path's time
        ([32], [2000], True),  # 0.70x and 0.82x
        ([32], [8000], True),  # 0.89x and 0.95x
        ([64], [2000], True),  # 0.80x and 0.92x
        ([48], [8000], False),  # 0.93x and 1.03x
        ([64], [8000], False),  # 0.91x and 1.12x
        ([128], [0], True),  # 0.95x and 0.95x
        ([128], [512], True),  # 0.81x and 0.96x
        ([128], [2000], False),  # 0.99x and 1.18x
        ([129], [0], False),  # more rows than the rule takes: little left to gain
        ([20, 12], [0, 8000], True),  # the key reads add up: 20 x 20 + 12 x 8012
        ([20, 33], [0, 8000], False),  # 33 x 8033 + 20 x 20: more than 32 tokens over 8,000 read
        ([], [], False),  # nothing to prefill
    ],
)
def test_decode_rows_where_they_measured_faster(lens, contexts, rows):
    assert prefill_as_decode_rows(lens, contexts) is rows


@pytest.mark.parametrize(
    ("tokens", "contexts", "paged"),
    [
        (8, [8000], True),  # measured 0.79x (1B) and 0.49x (8B) flash's time
        (2, [8000], True),  # 0.56x and 0.35x
        (16, [4096], True),  # 1.01x and 0.65x
        (32, [8000], True),  # 0.77x and 0.76x
        (64, [8000], False),  # 1.03x and 1.39x
        (1, [8000], False),  # 1.07x and 1.20x: flash's one-query case
        (4, [2000], False),  # 2.20x and 1.15x
        (16, [8000, 4096], True),  # every prompt's context long enough
        (8, [8000, 1000], False),  # one short context: its prompt's rows would not pay
    ],
)
def test_paged_only_where_it_measured_faster(tokens, contexts, paged):
    assert paged_prefill_pays(tokens, contexts) is paged
