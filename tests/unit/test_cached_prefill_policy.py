"""The rule that picks the paged decode kernel for a prefill over cached contexts, against the
H200 measurements it came from (`bench/results/cached_prefill_attention_h200.md`)."""

from __future__ import annotations

import pytest

from policies.cached_prefill import paged_prefill_pays


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
