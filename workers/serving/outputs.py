"""What an engine hands out: each step's `TokenEvent`s and its `EngineStatus`. Pure Python, no
torch: both cross to the replica (`workers/protocol.py` says how)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from workers.serving.sampling import TokenLogprob


@dataclass(frozen=True)
class KvCacheStatus:
    """The KV pool of one engine: its size (what a request's choices must fit) and its use."""

    page_size: int
    pages: int  # usable pages (the scratch page left out)
    pages_free: int
    pages_cached: int  # holding a cached prefix, held or idle
    max_num_seqs: int
    preemptions: int

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size


@dataclass(frozen=True)
class EngineStatus:
    """What an engine tells its replica (and operators) about itself: it crosses the engine
    process's pipe and Ray as it is; `as_dict` is its JSON form for /admin/status and /metrics."""

    state: str
    max_model_len: int
    model_revision: str
    attention_backend: str
    buckets: dict[str, dict]
    compile_s: float
    stats: dict
    memory_mb: dict[str, float]  # weights, kv_pool, graphs (and lora slots): this rank's device memory, apart
    kv_cache: KvCacheStatus
    lora: dict | None = None  # max_loras, max_lora_rank, target_modules, adapters (loaded), refused (path, reason)
    shards: list[dict] | None = None  # with tensor parallelism: each rank's own capture
    startup: dict | None = None  # total_s, phases (seconds each, `startup.py`), compiled_graphs
    prefill_buckets: dict[str, dict] | None = None  # per prefill bucket of token counts, as `buckets`

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for optional in ("shards", "lora", "startup", "prefill_buckets"):
            if out[optional] is None:
                del out[optional]
        return out


@dataclass(slots=True)
class TokenEvent:
    """New tokens of one request from one engine step; finish_reason is set on its last event,
    and error too when the request failed (its stream raises it). logprobs, for a request that
    asked for them: one per token. cached_tokens: on every event of a prefilled request."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: BaseException | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int | None = None  # prompt tokens its prefill found in the prefix cache; None: not said
