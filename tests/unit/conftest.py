"""Shared helpers for the CPU unit tests: small real checkpoints written to tmp dirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.modeling.synthetic import tiny_hf_config, write_checkpoint

# The shape every reference-model test uses: small enough for 2 CPU cores, with GQA (4 heads, 2 KV heads).
HF_SHAPE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(autouse=True)
def _few_threads():
    """Two cores shared with other work: keep torch from oversubscribing them."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_hf_checkpoint(path: Path, model_type: str, seed: int = 0, **extra):
    """Build transformers' own model of `model_type` (fp32, random normal(0, 0.1) weights), save it to
    `path` as a real checkpoint, and return the HF model in eval mode as the reference."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**HF_SHAPE, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(path)
    return model.eval()


def write_tiny_checkpoint(path: Path, seed: int = 0, vocab_size: int = 261, **overrides) -> Path:
    """The default model's shape (`tiny_hf_config`) with random weights, no tokenizer; `overrides`
    replace config fields (e.g. dtype="bfloat16"). Pass max_shard_tensors to shard it."""
    shard = overrides.pop("max_shard_tensors", 0)
    return write_checkpoint(path, {**tiny_hf_config(vocab_size), **overrides}, None, seed=seed, max_shard_tensors=shard)
