"""EngineConfig refuses limits that cannot work, naming the key: built directly (not through
AppConfig, which checks its own), a max_num_seqs of -1 failed inside torch and a negative
max_waiting was taken, shrinking the queue below the batch."""

from __future__ import annotations

import pytest

from workers.serving.engine_config import EngineConfig


@pytest.mark.parametrize(("key", "value"), [("max_num_seqs", 0), ("max_num_seqs", -1), ("max_waiting", -1)])
def test_a_limit_that_cannot_work_is_refused_naming_its_key(key, value):
    with pytest.raises(ValueError, match=f"{key} must be"):
        EngineConfig(**{key: value})


def test_the_smallest_limits_that_work_are_taken():
    config = EngineConfig(max_num_seqs=1, max_waiting=0)
    assert (config.max_num_seqs, config.max_waiting) == (1, 0)
    assert EngineConfig().max_num_seqs is None  # the device's default


def test_a_kv_pool_the_host_cannot_allocate_names_the_keys_that_size_it(monkeypatch):
    """max_num_seqs 65536 on CPU (where the pool holds every slot at max_model_len) failed every
    start with the allocator's "can't allocate memory: you tried to allocate 34359742464 bytes",
    naming no setting. The allocator's refusal is stood in for: asking this host for 32 GiB may
    also succeed, lazily."""
    from policies.graph_policy import GraphPolicy
    from workers.modeling.config import parse_config
    from workers.modeling.model import LlamaModel
    from workers.modeling.synthetic import tiny_hf_config
    from workers.serving.engine import LLMEngine

    model = LlamaModel(parse_config(tiny_hf_config(262)), 2048).eval()
    config = EngineConfig(max_num_seqs=65536, max_model_len=2048, graph_policy=GraphPolicy(mode="eager"))

    def refused(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: ...")

    monkeypatch.setattr(model, "make_kv_cache", refused)
    with pytest.raises(
        ValueError, match=r"KV pool of \d+ tokens \(max_num_seqs 65536 x max_model_len 2048: .* lower max_num_seqs"
    ):
        LLMEngine(model, config)

    def broken(*args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(model, "make_kv_cache", broken)
    with pytest.raises(RuntimeError, match="something else"):
        LLMEngine(model, config)
