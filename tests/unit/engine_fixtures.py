"""Shared helpers for the engine-level CPU tests: the embedded tiny model, loaded once per session.

Test modules wrap `load_tiny` in a session fixture of their own (importing a fixture by name trips
ruff's F811). The checkpoint is written to a tmp GRAPHSERVE_CACHE; the environment variable is set
only while loading, so other tests see their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from workers.modeling.default_model import default_model_dir
from workers.modeling.model import LlamaModel
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

TINY_MAX_MODEL_LEN = 64


@dataclass(frozen=True)
class Tiny:
    cache: Path  # the GRAPHSERVE_CACHE directory holding the default checkpoint
    model_dir: Path
    model: LlamaModel  # fp32 on CPU, max_model_len=TINY_MAX_MODEL_LEN; read-only, shared by engines
    tokenizer: object
    eos_token_ids: tuple[int, ...]

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len


_tiny: Tiny | None = None


def load_tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """The default model through `LLMEngine.from_config`, built once per test session."""
    global _tiny
    if _tiny is None:
        cache = tmp_path_factory.mktemp("graphserve-cache")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("GRAPHSERVE_CACHE", str(cache))
            engine, tokenizer = LLMEngine.from_config(
                EngineConfig(max_model_len=TINY_MAX_MODEL_LEN, max_num_seqs=1, device="cpu", dtype="float32")
            )
            model_dir = default_model_dir()
        assert model_dir.parent == cache
        assert engine.model.cfg.dtype == torch.float32 and engine.device.type == "cpu"  # exact comparisons hold
        _tiny = Tiny(cache, model_dir, engine.model, tokenizer, tuple(sorted(engine.eos_token_ids)))
    return _tiny


def new_engine(tiny: Tiny, **config) -> LLMEngine:
    """A fresh engine (own KV cache, scheduler, stats and grammar cache) over the shared model."""
    cfg = EngineConfig(max_model_len=tiny.max_model_len, device="cpu", **config)
    return LLMEngine(tiny.model, cfg, tiny.eos_token_ids, tokenizer=tiny.tokenizer)


def run_alone(tiny: Tiny, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """The request served on its own by a fresh one-slot engine: (output token ids, finish reason)."""
    engine = new_engine(tiny, max_num_seqs=1)
    seq = engine.add_request(prompt_ids, params)
    while engine.has_work():
        engine.step()
    return seq.output_ids, seq.finish_reason


def run_sync(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]):
    """All requests added at once to `engine` and stepped to completion; returns their Sequences."""
    seqs = [engine.add_request(p, params) for p, params in requests]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 10_000, "the engine does not finish"
    return seqs
