"""The compile cache's key: everything that decides the compiled decode step of a model served with
an engine config (`graphs/compile_cache.py` names a directory after its hash)."""

from __future__ import annotations

import dataclasses
import json

from workers.graphs import compile_cache
from workers.modeling.model import LlamaModel
from workers.serving.engine_config import EngineConfig


def key_inputs(model: LlamaModel, config: EngineConfig) -> dict:
    """Everything that decides the compiled decode step of `model` served with `config`, as JSON
    values (what the key file holds)."""
    device = model.embed.weight.device
    policy = config.graph_policy
    batch_limit = config.batch_limit(device)
    lora = config.lora
    inputs = {
        "model": {
            **{k: str(v) if k == "dtype" else v for k, v in dataclasses.asdict(model.cfg).items()},
            "max_model_len": model.max_model_len,
            "tensor_parallel_size": model.tp.world_size,
        },
        "engine": {
            "attention_backend": model.attention_backend.name,
            "kv_page_size": config.kv_page_size,
            "max_num_seqs": batch_limit,
            "graph_mode": policy.mode,
            "compile": policy.compiles,
            "buckets": list(policy.buckets(batch_limit)),
            "lora": None if lora is None else [lora.max_loras, lora.max_lora_rank, sorted(lora.target_modules)],
        },
        "versions": compile_cache.versions(device),
    }
    return json.loads(json.dumps(inputs))  # tuples become lists, as they read back
