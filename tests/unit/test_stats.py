"""EngineStats.graph_summary arithmetic from hand-fed record_step calls."""

from __future__ import annotations

import pytest

from workers.serving.stats import EngineStats


def fed(*parts: tuple[str, str, str, int, int]) -> EngineStats:
    stats = EngineStats("rev-1", "sdpa")
    for part in parts:
        stats.record_step(*part)
    return stats


def test_empty_summary():
    """No steps: zero rates, no parts, no division by zero."""
    s = EngineStats().graph_summary()
    assert s == {
        "graph_hit_rate": 0.0,
        "fallback_rate": {},
        "padding_waste": 0.0,
        "steps_by_bucket": {},
        "decode_step_parts": [],
    }


def test_mixed_graph_and_eager_parts():
    """Hit rate and fallback rates are over rows (not steps); padding waste counts graph parts only."""
    stats = fed(
        ("cuda_graph", "decode_bs_4", "none", 3, 1),
        ("cuda_graph", "decode_bs_4", "none", 4, 0),
        ("cuda_graph", "decode_bs_8", "none", 5, 3),
        ("eager", "none", "shape_miss", 40, 0),
        ("eager", "none", "tenant_disabled", 2, 0),
        ("eager", "none", "tenant_disabled", 6, 0),
    )
    s = stats.graph_summary()
    rows = 3 + 4 + 5 + 40 + 2 + 6  # 60
    assert s["graph_hit_rate"] == pytest.approx(12 / rows)
    assert s["fallback_rate"] == pytest.approx({"shape_miss": 40 / rows, "tenant_disabled": 8 / rows})
    assert list(s["fallback_rate"]) == ["shape_miss", "tenant_disabled"]
    assert s["padding_waste"] == pytest.approx(4 / (12 + 4))  # padding / (real + padding rows replayed)
    assert s["steps_by_bucket"] == {"decode_bs_4": 2, "decode_bs_8": 1, "none": 3}
    assert s["graph_hit_rate"] + sum(s["fallback_rate"].values()) == pytest.approx(1.0)


def test_decode_step_parts_accumulate_and_carry_labels():
    """Calls with the same (mode, bucket, reason) add up into one part with the engine's labels."""
    stats = fed(
        ("eager", "none", "unavailable", 3, 0),
        ("cuda_graph", "decode_bs_2", "none", 1, 1),
        ("eager", "none", "unavailable", 2, 0),
    )
    parts = stats.graph_summary()["decode_step_parts"]
    assert parts == [
        {
            "execution_mode": "cuda_graph",
            "bucket_id": "decode_bs_2",
            "fallback_reason": "none",
            "model_revision": "rev-1",
            "attention_backend": "sdpa",
            "steps": 1,
            "rows": 1,
            "padding_rows": 1,
        },
        {
            "execution_mode": "eager",
            "bucket_id": "none",
            "fallback_reason": "unavailable",
            "model_revision": "rev-1",
            "attention_backend": "sdpa",
            "steps": 2,
            "rows": 5,
            "padding_rows": 0,
        },
    ]


def test_all_eager_one_reason():
    s = fed(("eager", "none", "unavailable", 4, 0), ("eager", "none", "unavailable", 1, 0)).graph_summary()
    assert s["graph_hit_rate"] == 0.0
    assert s["fallback_rate"] == {"unavailable": 1.0}
    assert s["padding_waste"] == 0.0
    assert s["steps_by_bucket"] == {"none": 2}


def test_all_graph_no_padding():
    s = fed(("cuda_graph", "decode_bs_8", "none", 8, 0), ("cuda_graph", "decode_bs_1", "none", 1, 0)).graph_summary()
    assert s["graph_hit_rate"] == 1.0
    assert s["fallback_rate"] == {}
    assert s["padding_waste"] == 0.0
    assert s["steps_by_bucket"] == {"decode_bs_1": 1, "decode_bs_8": 1}


def test_eager_padding_is_not_padding_waste():
    """Padding reported on an eager part does not enter padding waste (only replayed rows do)."""
    s = fed(("cuda_graph", "decode_bs_4", "none", 2, 2), ("eager", "none", "shape_miss", 10, 5)).graph_summary()
    assert s["padding_waste"] == pytest.approx(2 / 4)


def test_piecewise_downgrade_counts_as_hit_and_as_its_reason():
    """A piecewise replay downgraded from full is a graph hit (not eager) and its rows also appear
    under backend_unsupported, so hit + fallback rates may exceed 1."""
    s = fed(
        ("piecewise", "decode_bs_4", "backend_unsupported", 3, 1),
        ("eager", "none", "shape_miss", 1, 0),
    ).graph_summary()
    assert s["graph_hit_rate"] == pytest.approx(3 / 4)
    assert s["fallback_rate"] == pytest.approx({"backend_unsupported": 3 / 4, "shape_miss": 1 / 4})
    assert s["padding_waste"] == pytest.approx(1 / 4)
    assert s["steps_by_bucket"] == {"decode_bs_4": 1, "none": 1}


def test_snapshot_includes_graph_summary():
    """snapshot() carries the same graph fields next to the step counters."""
    stats = fed(("cuda_graph", "decode_bs_4", "none", 3, 1), ("eager", "none", "shape_miss", 1, 0))
    stats.record_decode(4)
    snap = stats.snapshot()
    for key, value in stats.graph_summary().items():
        assert snap[key] == value
    assert snap["decode_steps"] == 1 and snap["decode_batch_sizes"] == {4: 1}
