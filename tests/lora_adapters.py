"""LoRA adapters made by the real `peft` library, for tests: random non-zero A and B
(init_lora_weights=False), so an adapter changes what the model computes."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model


def make_adapter(model, path, seed: int, **options):
    """A PEFT adapter of `model` (a transformers model) saved to path; returns the PEFT model."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **options))
    peft_model.save_pretrained(path)
    return peft_model.eval()


def adapter_for(base: Path, path: Path, seed: int, **options) -> Path:
    """A PEFT adapter of the checkpoint at `base`, saved to path (LoraConfig options, e.g. r=4)."""
    from transformers import AutoModelForCausalLM

    make_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), path, seed, **options)
    return path
