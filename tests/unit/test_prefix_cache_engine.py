"""Prefix caching through the engine (CPU, the tiny default model, fp32): a request that reuses
cached pages decodes exactly the tokens it decodes with caching off, greedy and seeded, whether its
shared prefix ends mid-page or on a page boundary or covers the whole prompt, within one step or
across steps, under page pressure (eviction and preemption); LoRA adapters, and loads of one
adapter, never share pages; a model swap forgets what the old weights cached; the counts reach
the request's events, the engine's status and /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch

from app.config import AppConfig
from app.metrics import render
from app.replica import engine_config
from policies.lora_slots import LoraLimits
from policies.prefix_cache import PrefixCache
from tests.lora_adapters import adapter_for
from tests.unit.engine_fixtures import Tiny, load_tiny, new_engine
from workers.front.async_engine import AsyncEngine
from workers.modeling.checkpoint import load_model
from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.model_gate import swap_weights_in_place
from workers.serving.sampling import SamplingParams
from workers.serving.scheduler import Sequence

PAGE = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
BASE = [random.Random(0).randrange(1, 250) for _ in range(40)]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def engine(tiny: Tiny, caching: bool = True, **config) -> LLMEngine:
    config = {"max_num_seqs": 4, "kv_page_size": PAGE, **config}
    return new_engine(tiny, enable_prefix_caching=caching, **config)


def serve(engine: LLMEngine, *requests: tuple[list[int], SamplingParams]) -> list[Sequence]:
    """The requests added together and stepped to completion."""
    seqs = [engine.add_request(p, params) for p, params in requests]
    while engine.has_work():
        engine.step()
    return seqs


def uncached(tiny: Tiny, prompt: list[int], params: SamplingParams) -> list[int]:
    return serve(engine(tiny, caching=False, max_num_seqs=1), (prompt, params))[0].output_ids


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(
    ("shared", "length", "cached"),
    [
        (10, 17, 8),  # the shared prefix ends mid-page: its two full pages are reused
        (12, 17, 12),  # ... on a page boundary: all three
        (17, 17, 16),  # the whole prompt, mid-page: every full page
        (16, 16, 12),  # the whole prompt, on a boundary: the page of its last token is computed again
    ],
)
def test_a_cached_prefix_decodes_what_caching_off_decodes(tiny, params, shared, length, cached):
    first = BASE[:shared] + [251] * (20 - shared)
    second = BASE[:shared] + [252] * (length - shared)
    e = engine(tiny)
    (warm,) = serve(e, (first, params))
    (hit,) = serve(e, (second, params))
    assert warm.cached_tokens == 0 and hit.cached_tokens == cached
    assert hit.output_ids == uncached(tiny, second, params)
    assert warm.output_ids == uncached(tiny, first, params)


def test_requests_admitted_in_one_step_share_the_pages_its_prefill_writes(tiny):
    """The second of two prompts sharing 12 tokens, admitted with the first, reads the pages the
    first writes in the same prefill (each layer writes before it attends)."""
    prompts = [BASE[:12] + [200, 201, 202], BASE[:12] + [210, 211]]
    e = engine(tiny)
    seqs = serve(e, *((p, GREEDY) for p in prompts))
    assert e.stats.prefill_steps == 1 and [s.cached_tokens for s in seqs] == [0, 12]
    assert [s.output_ids for s in seqs] == [uncached(tiny, p, GREEDY) for p in prompts]


def test_pages_decode_steps_fill_are_reused_by_a_longer_turn(tiny):
    """A chat's next turn: the last prompt plus its answer plus more. The answer's pages, written by
    decode steps, are reused too."""
    e = engine(tiny)
    (turn,) = serve(e, (BASE[:10], GREEDY))
    history = BASE[:10] + turn.output_ids + [240, 241, 242]
    (next_turn,) = serve(e, (history, GREEDY))
    assert next_turn.cached_tokens == 16  # 18 tokens written, the last page's 2 not full
    assert next_turn.output_ids == uncached(tiny, history, GREEDY)


def test_under_page_pressure_eviction_and_preemption_change_no_token(tiny, monkeypatch):
    """A pool of 20 pages for 4 slots of sequences of up to 12 pages: requests sharing three
    prefixes are preempted, re-prefilled from the cache, and idle cached pages are evicted."""
    rng = random.Random(3)
    prefixes = [BASE[:12], BASE[20:36], [5] * 8]
    requests = []
    for i in range(10):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 250) for _ in range(rng.randint(1, 6))]
        requests.append((prompt, dataclasses.replace(GREEDY if i % 2 else SEEDED, seed=i, max_tokens=24)))
    e = engine(tiny, kv_cache_tokens=20 * PAGE)
    evicted = []
    evict = PrefixCache.evict
    monkeypatch.setattr(PrefixCache, "evict", lambda self: evicted.append(evict(self)) or evicted[-1])
    seqs = []
    for wave in (requests[:4], requests[4:]):
        seqs += serve(e, *wave)
    assert e.scheduler.num_preempted > 0 and evicted
    lookups = e.stats.snapshot()["prefix_cache"]
    assert lookups["hits_tokens"] > 0 and lookups["queries_tokens"] > lookups["hits_tokens"]
    assert e.status().kv_cache.pages_free == 20  # every page back: free, or idle and cached
    assert [s.output_ids for s in seqs] == [uncached(tiny, p, params) for p, params in requests]


def test_caching_off_reuses_nothing(tiny):
    e = engine(tiny, caching=False)
    serve(e, (BASE[:20], GREEDY))
    (again,) = serve(e, (BASE[:20], GREEDY))
    status = e.status()
    assert again.cached_tokens == 0 and status.kv_cache.pages_cached == 0
    assert status.stats["prefix_cache"] == {"queries_tokens": 0, "hits_tokens": 0}


def test_the_counts_reach_events_status_and_metrics(tiny):
    e = engine(tiny)
    serve(e, (BASE[:20], GREEDY))
    seq = e.add_request(BASE[:20], GREEDY)
    first = e.step()
    assert [(ev.request_id, ev.cached_tokens) for ev in first] == [(seq.request_id, 16)]
    while e.has_work():
        e.step()
    status = e.status()
    assert status.kv_cache.pages_cached > 0
    assert status.stats["prefix_cache"] == {"queries_tokens": 40, "hits_tokens": 16}
    text = render({"r1": status.as_dict()}).decode()
    assert 'graphserve_prefix_cache_queries_tokens_total{replica="r1"} 40.0' in text
    assert 'graphserve_prefix_cache_hits_tokens_total{replica="r1"} 16.0' in text
    assert f'graphserve_kv_pages_cached{{replica="r1"}} {float(status.kv_cache.pages_cached)}' in text


def test_a_stream_carries_its_cached_tokens(tiny):
    """Through the asyncio front: every event of a request says how many prompt tokens it reused."""

    async def run() -> list[list[int]]:
        front = AsyncEngine(engine(tiny), tiny.tokenizer).start()
        try:
            out = []
            for _ in range(2):
                out.append([ev.cached_tokens async for ev in front.submit(BASE[:20], GREEDY)])
            return out
        finally:
            front.shutdown()

    first, second = asyncio.run(run())
    assert set(first) == {0} and set(second) == {16}


# ---------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefix-adapters")
    options = {"a": dict(r=4, lora_alpha=16, target_modules="all-linear"), "b": dict(r=2, lora_alpha=4)}
    options["b"]["target_modules"] = ["q_proj", "k_proj", "v_proj"]
    return {
        name: str(adapter_for(tiny.model_dir, root / name, seed=i + 1, **o))
        for i, (name, o) in enumerate(options.items())
    }


def lora_engine(tiny: Tiny, caching: bool = True, max_loras: int = 2) -> LLMEngine:
    model = load_model(tiny.model_dir, tiny.max_model_len, dtype=torch.float32)  # LoRA slots change it: a copy
    cfg = EngineConfig(
        max_model_len=tiny.max_model_len,
        device="cpu",
        max_num_seqs=2,
        kv_page_size=PAGE,
        lora=LoraLimits(max_loras=max_loras, max_lora_rank=8),
        enable_prefix_caching=caching,
    )
    return LLMEngine(model, cfg, tiny.eos_token_ids)


def with_adapter(engine: LLMEngine, prompt: list[int], name: str | None, adapters: dict[str, str]) -> Sequence:
    seq = engine.add_request(prompt, GREEDY, adapter=(name, adapters[name]) if name else None)
    while engine.has_work():
        engine.step()
    return seq


def test_adapters_never_share_pages_and_each_load_is_its_own(tiny, adapters):
    prompt = BASE[:20]
    e = lora_engine(tiny, max_loras=1)
    order = ["a", "b", None, "a", "a"]
    seqs = [with_adapter(e, prompt, name, adapters) for name in order]
    # a, then b (evicting a from the only slot), then the base model: each its own KV, no reuse;
    # a again is a new load of a (its generation): what the first load cached is not reused; then
    # a once more, the same load: it is.
    assert [s.cached_tokens for s in seqs] == [0, 0, 0, 0, 16]
    reference = lora_engine(tiny, caching=False, max_loras=1)
    assert [s.output_ids for s in seqs] == [with_adapter(reference, prompt, n, adapters).output_ids for n in order]
    assert seqs[0].output_ids != seqs[1].output_ids != seqs[2].output_ids  # the adapters matter here


# ---------------------------------------------------------------- model swap


def test_a_model_swap_forgets_what_the_old_weights_cached(tmp_path):
    tokenizer = build_byte_tokenizer()
    shape = tiny_hf_config(len(tokenizer))
    old, new = (write_checkpoint(tmp_path / n, shape, tokenizer, seed=s) for n, s in (("old", 1), ("new", 2)))

    def engine_on(path) -> LLMEngine:
        config = EngineConfig(model=str(path), max_num_seqs=2, max_model_len=64, device="cpu", kv_page_size=PAGE)
        return LLMEngine.from_config(config)[0]

    e = engine_on(old)
    (before,) = serve(e, (BASE[:20], GREEDY))
    swap_weights_in_place(e, dataclasses.replace(e.config, model=str(new)))
    (after,) = serve(e, (BASE[:20], GREEDY))
    assert after.cached_tokens == 0  # the old model's pages of this prompt are not reused
    (fresh,) = serve(engine_on(new), (BASE[:20], GREEDY))
    assert after.output_ids == fresh.output_ids != before.output_ids
    (again,) = serve(e, (BASE[:20], GREEDY))
    assert again.cached_tokens == 16 and again.output_ids == fresh.output_ids


def test_the_app_config_turns_it_on_by_default_and_off_when_asked():
    assert engine_config(AppConfig()).enable_prefix_caching
    assert not engine_config(AppConfig(enable_prefix_caching=False)).enable_prefix_caching
    assert AppConfig.model_fields["enable_prefix_caching"].description
