"""The compile cache key: it changes with each thing that decides the compiled step (the model's
config, length and shard count, the engine settings that shape the step, the software versions)
and with nothing else; its subdirectory holds the key's inputs and is where inductor and Triton
are pointed."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import workers.graphs.compile_cache as compile_cache
from policies.graph_policy import GraphPolicy
from policies.lora_slots import LoraLimits
from workers.graphs.compile_cache import KEY_FILE, cache_key, use_compile_cache
from workers.kv.attention import make_backend
from workers.modeling.config import parse_config
from workers.modeling.model import LlamaModel
from workers.modeling.parallel import TPGroup
from workers.modeling.synthetic import tiny_hf_config
from workers.serving.compile_key import key_inputs
from workers.serving.engine_config import EngineConfig

BASE = EngineConfig(max_num_seqs=8, max_model_len=64, device="cpu")


def model(max_model_len: int = 64, backend: str = "sdpa", tp: TPGroup | None = None, **hf) -> LlamaModel:
    m = LlamaModel(parse_config({**tiny_hf_config(300), **hf}), max_model_len, tp=tp, device="cpu")
    m.attention_backend = make_backend(backend, torch.device("cpu"))
    return m


def key(m: LlamaModel | None = None, **config) -> str:
    return cache_key(key_inputs(m or model(), dataclasses.replace(BASE, **config)))


def test_the_key_is_stable():
    assert key() == key()
    assert cache_key({"a": 1, "b": [2]}) == cache_key({"b": [2], "a": 1})


@pytest.mark.parametrize(
    "changed",
    [
        dict(hidden_size=128, intermediate_size=384),
        dict(num_hidden_layers=3),
        dict(num_key_value_heads=4),
        dict(vocab_size=301),
        dict(dtype="bfloat16"),
        dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        dict(tie_word_embeddings=True),
    ],
    ids=lambda d: next(iter(d)),
)
def test_a_changed_model_config_changes_the_key(changed):
    assert key(model(**changed)) != key()


@pytest.mark.parametrize(
    "changed",
    [
        dict(kv_page_size=32),
        dict(max_num_seqs=16),
        dict(graph_policy=GraphPolicy(decode_batch_buckets=(1, 2, 8))),
        dict(graph_policy=GraphPolicy(compile=False)),
        dict(graph_policy=GraphPolicy(mode="piecewise")),
        dict(lora=LoraLimits(max_loras=2, max_lora_rank=8)),
    ],
    ids=lambda d: next(iter(d)),
)
def test_engine_settings_that_shape_the_step_change_the_key(changed):
    assert key(**changed) != key()


def test_model_length_shards_and_attention_backend_change_the_key():
    assert key(model(max_model_len=128)) != key()
    assert key(model(backend="sdpa_varlen")) != key()
    sharded = key(model(tp=TPGroup(rank=0, world_size=2)))
    assert sharded != key()
    assert key(model(tp=TPGroup(rank=1, world_size=2))) == sharded  # same shard shapes: the ranks share it


@pytest.mark.parametrize(
    "changed",
    [
        dict(max_waiting=7),
        dict(kv_cache_tokens=4096),
        dict(kv_cache_memory_fraction=0.5),
        dict(max_num_batched_tokens=1024),
        dict(model_revision="v2"),
        dict(compile_cache_dir="/elsewhere"),
        dict(graph_policy=GraphPolicy(shadow_verify_every_n_steps=10, graph_memory_budget_mb=1)),
    ],
    ids=lambda d: next(iter(d)),
)
def test_settings_that_do_not_shape_the_step_keep_the_key(changed):
    assert key(**changed) == key()


@pytest.mark.parametrize("part", ["python", "torch", "cuda", "triton", "device"])
def test_each_version_changes_the_key(part, monkeypatch):
    before = key()
    real = compile_cache.versions
    monkeypatch.setattr(compile_cache, "versions", lambda device: {**real(device), part: "other"})
    assert key() != before


def test_use_compile_cache_points_inductor_and_triton_at_the_keyed_subdirectory(tmp_path, monkeypatch):
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(variable, raising=False)
    inputs = key_inputs(model(), BASE)
    directory = use_compile_cache(tmp_path, inputs)
    assert directory == tmp_path / cache_key(inputs)
    assert json.loads((directory / KEY_FILE).read_text()) == inputs
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(directory)
    assert os.environ["TRITON_CACHE_DIR"] == str(directory / "triton")
    assert use_compile_cache(tmp_path, inputs) == directory  # a second start (or replica) finds it
    assert use_compile_cache(tmp_path, key_inputs(model(max_model_len=32), BASE)) != directory
    assert len(list(tmp_path.iterdir())) == 2
