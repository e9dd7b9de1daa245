"""What an engine is started with: the model, its limits, the KV pool, the graph policy, LoRA slots.
Frozen, and the same on every tensor-parallel rank; it crosses to the engine process, so it
imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from policies.graph_policy import GraphPolicy
from policies.lora_slots import LoraLimits

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory; None = the embedded tiny default
    model_revision: str | None = None  # the model's label; None = a content id of the checkpoint
    gate_prompts_file: str | None = None  # JSON lines of {"prompt", "completion"} a swapped-in model must decode
    max_num_seqs: int | None = None  # the batch limit; None = 256 on CUDA, 32 on CPU
    max_model_len: int = 2048  # capped at the model's max_position_embeddings
    max_waiting: int = 1024
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0  # most prompt tokens a sequence prefills a step; 0: off (`prefill_pacing.py`)
    max_prefill_delay_ms: float = 0.0  # arrivals wait this long to be prefilled together (`prefill_waves.py`)
    device: str = "auto"  # auto = cuda when present
    dtype: str | None = None  # None = the checkpoint's
    attention_backend: str = "auto"  # auto = triton on CUDA, sdpa elsewhere (`attention.py`)
    kv_page_size: int = 16  # token positions per KV page
    kv_cache_tokens: int | None = None  # the KV pool's size in tokens; None = from free memory
    kv_cache_memory_fraction: float = 0.9  # of the device memory free after weights (`kv_sizing.py`)
    compile_cache_dir: str | None = None  # compile caches, a subdirectory per key (`compile_cache.py`); None: /tmp
    graph_policy: GraphPolicy = GraphPolicy()
    lora: LoraLimits | None = None  # adapter slots; None: LoRA off, and it costs nothing
    enable_prefix_caching: bool = True  # reuse the KV pages of a cached prompt prefix (`kv_blocks.py`)
    async_scheduling: bool = True  # launch each decode step before the last one's tokens are read (`engine.py`)

    def __post_init__(self) -> None:
        """Limits that cannot work, refused naming the key (others where their part is built)."""
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")

    def batch_limit(self, device: torch.device) -> int:
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return 256 if device.type == "cuda" else 32
