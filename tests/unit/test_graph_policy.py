"""GraphPolicy validation (defaults, every rejected value names its field) and load_policy sources."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from policies.graph_policy import GraphPolicy, default_buckets, load_policy

DEFAULTS = dict(
    mode="full",
    decode_batch_buckets=None,  # default_buckets(max_num_seqs)
    capture_prefill=True,
    prefill_token_buckets=None,  # default_prefill_buckets(max_num_batched_tokens)
    max_cached_graphs=None,
    graph_memory_budget_mb=2048,
    fallback_mode="eager",
    capture_on_startup=True,
    compile=None,
    shadow_verify_every_n_steps=1000,
)


def rejected(field: str, **values) -> list[dict]:
    """Build a policy from `values`, expect a ValidationError that names `field`; return its errors."""
    with pytest.raises(ValidationError) as exc:
        GraphPolicy(**values)
    errors = exc.value.errors()
    named = [e for e in errors if field in e["loc"] or field in e["msg"]]
    assert named, f"no error names {field!r}: {errors}"
    return named


# ---------------------------------------------------------------- defaults


def test_defaults_match_design():
    """Every default is the design's value (and there are no other fields)."""
    policy = GraphPolicy()
    assert policy.model_dump() == DEFAULTS
    assert set(GraphPolicy.model_fields) == set(DEFAULTS)


def test_policy_is_frozen():
    """A loaded policy cannot be changed in place."""
    policy = GraphPolicy()
    with pytest.raises(ValidationError):
        policy.mode = "eager"
    assert policy.mode == "full"


def test_valid_non_default_values_accepted():
    """Boundary values that are allowed: zero graphs, zero budget, one bucket, compile with full."""
    p = GraphPolicy(
        mode="piecewise",
        decode_batch_buckets=[3],
        max_cached_graphs=0,
        graph_memory_budget_mb=0,
        capture_on_startup=False,
    )
    assert p.decode_batch_buckets == (3,) and p.max_cached_graphs == 0 and p.graph_memory_budget_mb == 0
    assert GraphPolicy(mode="full", compile=True).compile is True
    assert GraphPolicy(mode="eager").mode == "eager"


# ---------------------------------------------------------------- rejections


def test_unknown_mode_rejected():
    """mode must be full, piecewise or eager."""
    (err,) = rejected("mode", mode="graphs")
    assert err["type"] == "literal_error"


def test_unknown_field_rejected():
    """A typo of a field name is an error, not silently ignored."""
    (err,) = rejected("max_cached_graph", max_cached_graph=3)
    assert err["type"] == "extra_forbidden"


def test_empty_buckets_rejected():
    (err,) = rejected("decode_batch_buckets", decode_batch_buckets=())
    assert "at least one bucket" in err["msg"]


@pytest.mark.parametrize("buckets", [(0, 1, 2), (-4,), (1, 2, 0)])
def test_non_positive_bucket_rejected(buckets):
    (err,) = rejected("decode_batch_buckets", decode_batch_buckets=buckets)
    assert ">= 1" in err["msg"]


@pytest.mark.parametrize("buckets", [(2, 1), (1, 4, 2, 8), (1, 2, 2, 4), (4, 4)])
def test_unsorted_or_duplicate_buckets_rejected(buckets):
    (err,) = rejected("decode_batch_buckets", decode_batch_buckets=buckets)
    assert "strictly increasing" in err["msg"]


def test_negative_max_cached_graphs_rejected():
    (err,) = rejected("max_cached_graphs", max_cached_graphs=-1)
    assert err["type"] == "greater_than_equal"


def test_negative_budget_rejected():
    (err,) = rejected("graph_memory_budget_mb", graph_memory_budget_mb=-0.5)
    assert err["type"] == "greater_than_equal"


@pytest.mark.parametrize("buckets", [(), (0, 16), (32, 16), (16, 16)])
def test_prefill_token_buckets_must_be_positive_and_increasing(buckets):
    rejected("prefill_token_buckets", prefill_token_buckets=buckets)


@pytest.mark.parametrize("fallback", ["piecewise", "cuda_graph", "none"])
def test_fallback_mode_other_than_eager_rejected(fallback):
    rejected("fallback_mode", fallback_mode=fallback)


@pytest.mark.parametrize("mode", ["piecewise", "eager"])
def test_compile_needs_mode_full(mode):
    """compile: true is only valid with mode full; the model-level error names both fields."""
    (err,) = rejected("compile", mode=mode, compile=True)
    assert "mode" in err["msg"] and "full" in err["msg"]


# ---------------------------------------------------------------- load_policy


def test_load_none_gives_defaults():
    assert load_policy(None) == GraphPolicy()


def test_load_from_yaml_section(tmp_path: Path):
    """The `cuda_graph_policy` section of a YAML file is read (other sections ignored); str and
    Path both work; a YAML list of buckets becomes a tuple."""
    path = tmp_path / "serve.yaml"
    path.write_text(
        "server:\n  port: 8000\n"
        "cuda_graph_policy:\n"
        "  mode: piecewise\n"
        "  decode_batch_buckets: [1, 3, 12]\n"
        "  max_cached_graphs: 2\n"
        "  graph_memory_budget_mb: 512.5\n"
        "  capture_on_startup: false\n"
    )
    expected = GraphPolicy(
        mode="piecewise",
        decode_batch_buckets=(1, 3, 12),
        max_cached_graphs=2,
        graph_memory_budget_mb=512.5,
        capture_on_startup=False,
    )
    assert load_policy(path) == expected
    assert load_policy(str(path)) == expected
    assert load_policy(path).decode_batch_buckets == (1, 3, 12)


def test_load_from_yaml_invalid_value_names_field(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("cuda_graph_policy:\n  decode_batch_buckets: [4, 2]\n")
    with pytest.raises(ValidationError, match="decode_batch_buckets"):
        load_policy(path)


def test_load_from_empty_yaml_gives_defaults(tmp_path: Path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_policy(path) == GraphPolicy()


def test_load_from_dict_with_and_without_section():
    """A dict may be the whole config (with the section key) or the section itself."""
    section = {"mode": "eager", "max_cached_graphs": 1}
    assert load_policy({"cuda_graph_policy": section}) == GraphPolicy(mode="eager", max_cached_graphs=1)
    assert load_policy(section) == GraphPolicy(mode="eager", max_cached_graphs=1)
    assert load_policy({}) == GraphPolicy()


def test_load_from_dict_rejects_typo():
    with pytest.raises(ValidationError, match="capture_on_start"):
        load_policy({"cuda_graph_policy": {"capture_on_start": False}})


def test_default_buckets_follow_max_num_seqs():
    """Dense at the small end, every 8 to 64, every 32 beyond, and always the batch limit itself."""
    assert default_buckets(256) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256)
    assert default_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert default_buckets(100)[-3:] == (64, 96, 100) and default_buckets(1) == (1,) and default_buckets(3) == (1, 2, 3)
    assert GraphPolicy().buckets(32) == default_buckets(32)
    assert GraphPolicy(decode_batch_buckets=(1, 5)).buckets(256) == (1, 5)


def test_compile_defaults_on_with_full_graphs_only():
    assert GraphPolicy().compiles and GraphPolicy(mode="full").compiles
    assert not GraphPolicy(mode="piecewise").compiles and not GraphPolicy(mode="eager").compiles
    assert not GraphPolicy(compile=False).compiles and GraphPolicy(compile=True).compiles
