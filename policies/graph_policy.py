"""The CUDA-graph policy: what to capture and how much memory graphs may take.

Validated by pydantic; an invalid value fails with a message that names the field. Loaded from the
`cuda_graph_policy` section of a YAML file or from a plain dict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class GraphPolicy(BaseModel):
    """What a replica captures; the `cuda_graph_policy` section, or `PUT /admin/graph-policy`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["full", "piecewise", "eager"] = Field(
        "full",
        description="`full` captures the whole decode step; `piecewise` captures the stretches between attention "
        "calls and runs attention eager; `eager` captures nothing (reason `disabled`)",
    )
    decode_batch_buckets: tuple[int, ...] | None = Field(
        None,
        description="the decode batch sizes to capture, strictly increasing, each >= 1; null: 1, 2, 4, 8, every 8 "
        "to 64, every 32 to max_num_seqs (17 for 256)",
    )
    capture_prefill: Literal[False] = Field(False, description="prefill always runs eager (not captured)")
    max_cached_graphs: int | None = Field(
        None,
        ge=0,
        description="at most this many buckets are captured, largest first; the others run eager "
        "(`evicted`). null: every bucket",
    )
    graph_memory_budget_mb: float = Field(
        2048,
        ge=0,
        description="memory all captured graphs may take, kept out of the KV pool; a bucket that would "
        "pass it runs eager (`evicted`)",
    )
    fallback_mode: Literal["eager"] = Field(
        "eager", description="how a step without a graph runs: eager, with a fallback reason"
    )
    capture_on_startup: bool = Field(
        True,
        description="capture every bucket before the replica is READY; false: nothing is captured, every "
        "step runs eager (reason `disabled`)",
    )
    compile: bool | None = Field(
        None,
        description="inductor-compile the decode step, then capture it; needs mode `full`. null: true with mode "
        "`full` (the compiled step won at every batch size measured)",
    )
    shadow_verify_every_n_steps: int = Field(
        1000,
        ge=0,
        description="every n-th replayed decode step is recomputed eagerly and must match bit for bit (0: never)",
    )

    @field_validator("decode_batch_buckets")
    @classmethod
    def _buckets_ascending(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("needs at least one bucket")
        if any(b < 1 for b in v):
            raise ValueError("bucket sizes must be >= 1")
        if list(v) != sorted(set(v)):
            raise ValueError("bucket sizes must be strictly increasing")
        return v

    @model_validator(mode="after")
    def _compile_needs_full(self) -> GraphPolicy:
        if self.compile and self.mode != "full":
            raise ValueError("compile: true needs mode: full (piecewise pieces are not compiled)")
        return self

    @property
    def compiles(self) -> bool:
        """Whether the decode step is inductor-compiled before capture (where graphs are captured)."""
        return self.mode == "full" if self.compile is None else self.compile

    def buckets(self, max_num_seqs: int) -> tuple[int, ...]:
        """The decode batch sizes to capture for a batch limit of max_num_seqs."""
        return self.decode_batch_buckets or default_buckets(max_num_seqs)


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 to 64, then every 32, up to and including max_num_seqs. Padding a
    batch up to its bucket costs little where a step reads mostly weights (small batches) and more
    where it computes (large ones), so buckets are dense at the small end; 256 needs 17 graphs."""
    ladder = [1, 2, 4, *range(8, 64, 8), *range(64, max_num_seqs, 32)]
    return (*[b for b in ladder if b < max_num_seqs], max_num_seqs)


def load_policy(source: str | Path | dict[str, Any] | None) -> GraphPolicy:
    """From a YAML path, a dict (with or without the `cuda_graph_policy` key), or defaults."""
    if source is None:
        return GraphPolicy()
    raw = source if isinstance(source, dict) else yaml.safe_load(Path(source).read_text()) or {}
    return GraphPolicy.model_validate(raw.get("cuda_graph_policy", raw))
