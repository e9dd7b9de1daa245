"""Prefill graphs on the GPU: captured pieces replay what their eager twin computes (bf16, the packed
flash path between them, cached contexts, several prompts, padding), and close to the plain
prefill; an engine whose prefills replay decodes token for token what one without prefill graphs
decodes (fp32: staggered arrivals, chunked prefill, prefix-cache hits, a denied request, prompts
above the ladder), and reports its prefill buckets."""

from __future__ import annotations

import pytest
import torch

from policies.graph_policy import GraphPolicy
from tests.prefill_batches import packed, random_prompts, run_staggered
from workers.graphs.prefill_graphs import PrefillGraphs
from workers.kv.prefill_attention import packed_supported
from workers.modeling.checkpoint import load_model
from workers.modeling.default_model import default_model_dir
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.gpu
PAGE = 16
BUCKETS = (16, 64, 256)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "models"))


@torch.inference_mode()
def test_replayed_prefill_pieces_equal_their_eager_twin_in_bf16():
    model = load_model(default_model_dir(), 512, "cuda", torch.bfloat16)
    cache = model.make_kv_cache(num_slots=4, page_size=PAGE)
    per_slot = 512 // PAGE
    cache.set_pages([v for slot in range(4) for i in range(per_slot) for v in (slot, i, 1 + slot * per_slot + i)])
    graphs = PrefillGraphs(model, cache, BUCKETS)
    graphs.warmup()
    graphs.capture(budget_bytes=1 << 30)
    graphs.verify()
    assert graphs.table.ready == set(BUCKETS) and packed_supported(graphs.pieces.q, None)
    vocab = model.cfg.vocab_size
    for seed, (lens, contexts) in enumerate([([5], [0]), ([40, 3, 17], [0, 32, 0]), ([100, 90, 7, 50], [16, 0, 0, 3])]):
        prompts = random_prompts([n + c for n, c in zip(lens, contexts)], vocab, seed)
        cached = [(p[:c], slot) for slot, (p, c) in enumerate(zip(prompts, contexts)) if c]
        for p, slot in cached:  # the contexts' K/V, from a plain prefill
            graphs.pieces.run(packed([p], [slot], [0]), 64)
        b = packed(prompts, list(range(len(prompts))), contexts)
        twin, dispatch = graphs.prefill(b, graphs=False, plain=None)
        replayed, replay_dispatch = graphs.prefill(b, graphs=True, plain=None)
        assert replay_dispatch.bucket == dispatch.bucket == min(x for x in BUCKETS if x >= len(b.tokens))
        torch.testing.assert_close(replayed, twin, rtol=1e-3, atol=1e-3)
        assert torch.equal(replayed.argmax(-1), twin.argmax(-1))
        tokens, positions, slots, _ = b.to_device(torch.device("cuda"))
        plain = model.prefill(tokens, positions, slots, b.lens, cache, None, b.context_lens)
        assert (replayed.float() - plain.float()).abs().max() <= 0.05 * plain.float().abs().max()


def engine(capture_prefill: bool, **config) -> LLMEngine:
    policy = GraphPolicy(
        compile=False, decode_batch_buckets=(1, 2, 4, 8), prefill_token_buckets=BUCKETS, capture_prefill=capture_prefill
    )
    config = EngineConfig(
        max_num_seqs=8,
        max_model_len=512,
        device="cuda",
        graph_policy=policy,
        kv_page_size=PAGE,
        dtype="float32",
        **config,
    )
    return LLMEngine.from_config(config)[0]


@pytest.mark.parametrize("budget", [None, 96])
def test_an_engine_replaying_prefill_graphs_decodes_what_one_without_does(budget):
    config = {} if budget is None else {"max_num_batched_tokens": budget}
    plain, graphed = engine(False, **config), engine(True, **config)
    assert graphed.runner.prefill_graphs.table.ready == {b for b in BUCKETS if b <= (budget or 512)}
    vocab = plain.model.cfg.vocab_size
    shared = random_prompts([70], vocab, seed=11)[0]
    prompts = random_prompts([3, 61, 17, 200, 9, 33, 130, 5], vocab, seed=3)
    prompts += [shared + [1, 2], random_prompts([300], vocab, seed=12)[0], shared + [3, 4, 5]]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0 if i % 3 else 0.9, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    assert run_staggered(graphed, prompts, params, 3, denied=frozenset({4})) == run_staggered(plain, prompts, params, 3)
    parts = {(p["execution_mode"], p["fallback_reason"]) for p in graphed.status().stats["prefill_step_parts"]}
    assert ("piecewise", "none") in parts and ("eager", "tenant_disabled") in parts
    report = graphed.status().prefill_buckets
    assert all(report[f"prefill_tokens_{b}"]["memory_mb"] >= 0 for b in graphed.runner.prefill_graphs.table.ready)
