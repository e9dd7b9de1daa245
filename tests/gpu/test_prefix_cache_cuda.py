"""Prefix caching on the GPU: the packed flash-attention prefill after a cached context attends as
one SDPA call per prompt with the context's mask does (bf16/fp16, with and without a sliding
window); a model's prefill after cached pages gives a full prefill's logits (bf16, the packed
path); and with captured decode graphs, requests that reuse cached pages decode exactly what they
decode with caching off (the default model in fp32, greedy and seeded, also under page pressure,
and short turns whose prefill attention runs on the paged decode kernel); short prefills replaying
the decode step, a row per token, decode what the prefill path decodes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policies import cached_prefill
from policies.graph_policy import GraphPolicy
from workers.kv import prefill_attention
from workers.kv.prefill_attention import PackedPrompts, packed_attention, packed_supported, per_prompt_attention
from workers.modeling.checkpoint import load_model
from workers.modeling.default_model import default_model_dir
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.gpu
PAGE = 16


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "models"))


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_after_a_cached_context_equals_per_prompt(window, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    lens, contexts = [1, 7, 33, 130, 5], [64, 0, 17, 256, 3]
    heads, kv_heads, dim = 8, 2, 64
    keys = sum(lens) + sum(contexts)
    q = torch.randn(sum(lens), heads, dim, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(keys, kv_heads, dim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    assert packed_supported(q, window)
    packed = packed_attention(q, k, v, PackedPrompts(lens, q.device, contexts), window)
    reference = per_prompt_attention(q, k, v, lens, window, contexts)
    assert packed.shape == reference.shape == (sum(lens), heads * dim)
    torch.testing.assert_close(packed.float(), reference.float(), atol=2e-2, rtol=2e-2)


@torch.inference_mode()
def test_a_bf16_prefill_after_cached_pages_gives_a_full_prefills_logits():
    model = load_model(default_model_dir(), 256, "cuda", torch.bfloat16)
    cache = model.make_kv_cache(num_slots=2, page_size=PAGE)
    pages = 256 // PAGE
    cache.set_pages([v for slot in (0, 1) for i in range(pages) for v in (slot, i, 1 + slot * pages + i)])
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).cuda()
    cached = 128

    def prefill(tokens, start, slot, context=None):
        positions = torch.arange(start, start + len(tokens), device="cuda")
        slots = torch.full((len(tokens),), slot, device="cuda")
        return model.prefill(tokens, positions, slots, [len(tokens)], cache, None, context)

    full = prefill(prompt, 0, 1)
    prefill(prompt[:cached], 0, 0)
    tail = prefill(prompt[cached:], cached, 0, [cached])
    assert packed_supported(model.embed.weight, model.cfg.sliding_window)  # the flash path ran
    # bf16 activations computed in other shapes: close, not equal (a wrong mask is far off)
    assert (tail - full).abs().max() <= 0.05 * full.abs().max()  # measured 0.015 on CPU; no context: 0.18
    assert torch.equal(tail.argmax(-1), full.argmax(-1))


def engine(caching: bool, max_model_len: int = 256, **config) -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=8,
        max_model_len=max_model_len,
        device="cuda",
        graph_policy=GraphPolicy(compile=False),
        kv_page_size=PAGE,
        enable_prefix_caching=caching,
        dtype="float32",  # bf16 K/V of a prefix prefilled in another shape round differently: near ties flip
        **config,
    )
    return LLMEngine.from_config(config)[0]


def serve(e: LLMEngine, requests) -> list:
    seqs = [e.add_request(p, params) for p, params in requests]
    while e.has_work():
        e.step()
    return seqs


@pytest.mark.parametrize("pool", [None, 24 * PAGE], ids=["ample-pool", "small-pool"])
def test_cached_requests_decode_with_graphs_what_uncached_ones_decode(pool):
    """Turns of chats sharing a long system prompt: prefixes that end mid-page, on a boundary, and
    whole prompts cached; greedy and seeded; graphs replaying every decode step."""
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 256, (70,), generator=g).tolist()
    requests = []
    for i in range(8):
        user = torch.randint(0, 256, (3 + 7 * i,), generator=g).tolist()
        params = SamplingParams(max_tokens=32, temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=100 + i)
        requests.append((system + user, params))
    requests += [(system[:64], requests[0][1]), (system[:64], dataclasses.replace(requests[1][1], seed=7))]
    cached, uncached = engine(True, kv_cache_tokens=pool), engine(False, kv_cache_tokens=pool)
    # the first turn alone, then the rest: the system prompt's pages are cached from there on
    seqs = [serve(cached, requests[:1]) + serve(cached, requests[1:])]
    seqs.append(serve(uncached, requests[:1]) + serve(uncached, requests[1:]))
    assert [s.output_ids for s in seqs[0]] == [s.output_ids for s in seqs[1]]
    if pool is None:  # 4 pages of the system prompt; a 64-token prompt computes its last page again
        assert [s.cached_tokens for s in seqs[0]] == [0] + [64] * 7 + [48, 48]
    status = cached.status()
    parts = status.stats["decode_step_parts"]
    assert sum(p["rows"] for p in parts if p["execution_mode"] == "cuda_graph") > 0
    assert status.stats["prefix_cache"]["hits_tokens"] > 0
    if pool is not None:
        assert status.kv_cache.preemptions > 0
    assert status.kv_cache.pages_free == status.kv_cache.pages


def test_short_turns_on_the_paged_kernel_decode_what_uncached_ones_decode(monkeypatch):
    """Follow-ups of 2 to 20 new tokens after a cached 600-token history, the rule's minimum context
    lowered to 512 for the default model's 4,096 positions: their prefills' attention runs as rows
    of the paged decode kernel, and they decode (fp32, greedy and seeded, graphs replaying) what
    they decode with caching off; a 40-token turn stays on the other path."""
    cached, uncached = engine(True, max_model_len=768), engine(False, max_model_len=768)
    monkeypatch.setattr(cached_prefill, "PAGED_MIN_CONTEXT", 512)
    picked = []  # the rule's answers from here on (not the engines' start-up prefills)
    pays = prefill_attention.paged_prefill_pays

    def recorded(tokens: int, context_lens: list[int]) -> bool:
        picked.append(pays(tokens, context_lens))
        return picked[-1]

    monkeypatch.setattr(prefill_attention, "paged_prefill_pays", recorded)
    g = torch.Generator().manual_seed(2)
    history = torch.randint(0, 256, (600,), generator=g).tolist()
    requests = [
        (
            history + torch.randint(0, 256, (n,), generator=g).tolist(),
            SamplingParams(max_tokens=16, temperature=t, seed=n),
        )
        for n, t in [(2, 0.0), (9, 0.8), (20, 0.0), (40, 0.8)]
    ]
    got = [serve(cached, [r])[0] for r in requests]
    want = [serve(uncached, [r])[0] for r in requests]
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert [s.cached_tokens for s in got] == [0, 592, 592, 592]  # 37 full pages of the first prompt
    assert picked == [True, True, False]  # 8 + 2, 8 + 9 and 8 + 20 new tokens; not 8 + 40; no call uncached


def test_short_prefills_replaying_the_decode_step_decode_what_the_prefill_path_decodes():
    """Follow-ups of 1 to 31 new tokens after a cached 300-token history, and fresh prompts of 2 to
    24 tokens, with decode graphs of up to 32 rows: their prefills replay the decode step, a row a
    token, and they decode (fp32, greedy and seeded, graphs replaying) what they decode where every
    prefill takes the prefill path (`capture_prefill` off)."""

    def make(capture_prefill: bool) -> LLMEngine:
        policy = GraphPolicy(compile=False, capture_prefill=capture_prefill)
        config = EngineConfig(
            max_num_seqs=32, max_model_len=512, device="cuda", graph_policy=policy, kv_page_size=PAGE, dtype="float32"
        )
        return LLMEngine.from_config(config)[0]

    g = torch.Generator().manual_seed(3)
    history = torch.randint(0, 256, (300,), generator=g).tolist()
    prompts = [history] + [history + torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 6, 19, 31)]
    prompts += [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 9, 24)]
    requests = [(p, SamplingParams(max_tokens=12, temperature=0.8 * (i % 2), seed=i)) for i, p in enumerate(prompts)]
    rows, prefill_path = make(True), make(False)
    got = [serve(rows, [r])[0].output_ids for r in requests]
    assert got == [serve(prefill_path, [r])[0].output_ids for r in requests]
    parts = rows.status().stats["prefill_step_parts"]
    as_rows = {p["bucket_id"]: p["steps"] for p in parts if p["bucket_id"].startswith("decode_bs")}
    # 300 = 18 pages + 12: a follow-up prefills those 12 and its own tokens (13, 18, 31 as rows; 43
    # above the largest bucket, on the prefill path), a fresh prompt its own (2, 9, 24)
    assert as_rows == {"decode_bs_16": 2, "decode_bs_24": 2, "decode_bs_32": 1, "decode_bs_2": 1}
    assert all(p["execution_mode"] == "cuda_graph" for p in parts if p["bucket_id"] in as_rows)


@pytest.mark.parametrize("budget", [7, 40])
def test_chunked_prefill_decodes_with_graphs_what_whole_prefills_decode(budget):
    """Step budgets of 7 and 40 tokens cut prompts of 3 to 120 tokens inside pages and across
    them, beside requests decoding by graph replay: greedy and seeded tokens equal those of one
    prefill per prompt (fp32), with prefix caching on, and a small pool preempting between chunks."""
    g = torch.Generator().manual_seed(1)
    requests = []
    for i in range(8):
        prompt = torch.randint(0, 256, (3 + 17 * i,), generator=g).tolist()
        requests.append((prompt, SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=200 + i)))
    for pool in (None, 40 * PAGE):
        whole = engine(True, kv_cache_tokens=pool)
        chunked = engine(True, kv_cache_tokens=pool, max_num_batched_tokens=budget)
        assert [s.output_ids for s in serve(chunked, requests)] == [s.output_ids for s in serve(whole, requests)]
        parts = chunked.status().stats["decode_step_parts"]
        assert sum(p["rows"] for p in parts if p["execution_mode"] == "cuda_graph") > 0
        assert chunked.stats.prefill_steps > whole.stats.prefill_steps
