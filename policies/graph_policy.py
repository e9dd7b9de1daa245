"""The CUDA-graph policy: what to capture and how much memory graphs may take.

Validated by pydantic; an invalid value fails with a message that names the field. Loaded from the
`cuda_graph_policy` section of a YAML file or from a plain dict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

MAX_GRAPH_MEMORY_MB = 1 << 20  # a terabyte: more than any device holds


class GraphPolicy(BaseModel):
    """What a replica captures; the `cuda_graph_policy` section, or `PUT /admin/graph-policy`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["full", "piecewise", "eager"] = Field(
        "full",
        description="`full` captures the whole decode step; `piecewise` captures the stretches between attention "
        "calls and runs attention eager; `eager` captures nothing (reason `disabled`)",
    )
    decode_batch_buckets: tuple[StrictInt, ...] | None = Field(
        None,
        description="the decode batch sizes to capture, strictly increasing, each >= 1; null: 1, 2, 4, 8, every 8 "
        "to 64, every 32 to max_num_seqs (17 for 256)",
    )
    capture_prefill: StrictBool = Field(
        True,
        description="capture a prefill's pieces between attention calls once per bucket of token counts "
        "(`prefill_token_buckets`) and run attention eager between them, and run a prefill of a few tokens "
        "as rows of the captured decode step; false: prefill runs eager",
    )
    prefill_token_buckets: tuple[StrictInt, ...] | None = Field(
        None,
        description="the prefill token counts to capture, strictly increasing; a prefill of more tokens than "
        "the largest runs eager. null: 16, 32, ... 512, then every 256 to 2048, none above "
        "max_num_batched_tokens",
    )
    max_cached_graphs: StrictInt | None = Field(
        None,
        ge=0,
        description="at most this many buckets are captured, largest first; the others run eager "
        "(`evicted`). null: every bucket",
    )
    graph_memory_budget_mb: StrictFloat = Field(
        2048,
        ge=0,
        le=MAX_GRAPH_MEMORY_MB,
        allow_inf_nan=False,
        description="memory all captured graphs may take, kept out of the KV pool; a bucket that would "
        "pass it runs eager (`evicted`)",
    )
    fallback_mode: Literal["eager"] = Field(
        "eager", description="how a step without a graph runs: eager, with a fallback reason"
    )
    capture_on_startup: StrictBool = Field(
        True,
        description="capture every bucket before the replica is READY; false: nothing is captured, every "
        "step runs eager (reason `disabled`)",
    )
    compile: StrictBool | None = Field(
        None,
        description="inductor-compile the decode step, then capture it; needs mode `full`. null: true with mode "
        "`full` (the compiled step won at every batch size measured)",
    )
    shadow_verify_every_n_steps: StrictInt = Field(
        1000,
        ge=0,
        description="every n-th replayed decode step is recomputed eagerly and must match bit for bit (0: never)",
    )

    @field_validator("decode_batch_buckets", "prefill_token_buckets")
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

    def check_fits(self, max_num_seqs: int) -> None:
        """A decode bucket larger than the batch can ever be would only take memory (a bucket of 10^9
        rows would try to allocate its inputs): ValueError naming them."""
        beyond = [b for b in self.decode_batch_buckets or () if b > max_num_seqs]
        if beyond:
            shown = f"{beyond[:8]}" if len(beyond) <= 8 else f"{beyond[:8]} and {len(beyond) - 8} more"
            raise ValueError(f"decode_batch_buckets: {shown} above max_num_seqs={max_num_seqs}")

    def buckets(self, max_num_seqs: int) -> tuple[int, ...]:
        """The decode batch sizes to capture for a batch limit of max_num_seqs."""
        return self.decode_batch_buckets or default_buckets(max_num_seqs)

    def prefill_buckets(self, max_num_batched_tokens: int) -> tuple[int, ...]:
        """The prefill token counts to capture for a step budget of max_num_batched_tokens (none
        when prefill is not captured): no bucket above what a step can hold."""
        if not self.capture_prefill or self.mode == "eager" or not self.capture_on_startup:
            return ()
        ladder = self.prefill_token_buckets or default_prefill_buckets(max_num_batched_tokens)
        return tuple(b for b in ladder if b <= max_num_batched_tokens)


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 to 64, then every 32, up to and including max_num_seqs. Padding a
    batch up to its bucket costs little where a step reads mostly weights (small batches) and more
    where it computes (large ones), so buckets are dense at the small end; 256 needs 17 graphs."""
    ladder = [1, 2, 4, *range(8, 64, 8), *range(64, max_num_seqs, 32)]
    return (*[b for b in ladder if b < max_num_seqs], max_num_seqs)


def default_prefill_buckets(max_num_batched_tokens: int, largest: int = 2048) -> tuple[int, ...]:
    """16, 32, ... 512, then every 256 to `largest`, the step budget itself where it is smaller.
    While a prefill's time is its launches, padding costs nothing and powers of two suffice; where
    it starts to compute, finer steps keep the padding under a third. Measured eager on the 1B
    shape (`bench/results/prefill_shapes_h200.md`): ~11 ms from 137 to 1,781 tokens (launches),
    25 ms at 4,384 (compute): above ~2k tokens the launches are a small part of a prefill, so
    larger ones run eager rather than hold a larger graph pool."""
    top = min(max_num_batched_tokens, largest)
    ladder = [16, 32, 64, 128, 256, *range(512, largest + 1, 256)]
    return (*[b for b in ladder if b < top], top)


def load_policy(source: str | Path | dict[str, Any] | None) -> GraphPolicy:
    """From a YAML path, a dict (with or without the `cuda_graph_policy` key), or defaults."""
    if source is None:
        return GraphPolicy()
    raw = source if isinstance(source, dict) else yaml.safe_load(Path(source).read_text()) or {}
    return GraphPolicy.model_validate(raw.get("cuda_graph_policy", raw))
