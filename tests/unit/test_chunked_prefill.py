"""Chunked prefill through the engine (CPU, the tiny default model, fp32): with a step budget
(`max_num_batched_tokens`) smaller than the prompts, long prompts go in over several steps while
the running requests decode every step, and every request decodes exactly the tokens it decodes
unchunked: greedy and seeded, chunk boundaries inside pages and across them, with prefix caching on
and off, under page pressure (a sequence preempted between its chunks), with LoRA adapters, and on
two tensor-parallel ranks (the follower gets the same chunks). Paced by `long_prefill_token_threshold`
too: no chunk is longer than it, and the tokens are the same."""

from __future__ import annotations

import random

import pytest

from policies.lora_slots import LoraLimits
from tests.lora_adapters import adapter_for
from tests.unit.engine_fixtures import Tiny, load_tiny, new_engine
from tests.unit.test_tp_startup import rank_engine, start_two_ranks
from workers.modeling.default_model import default_model_dir
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(180)
PAGE = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
RNG = random.Random(3)
PROMPTS = [[RNG.randrange(1, 250) for _ in range(n)] for n in (37, 6, 23, 50, 9)]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[list[int]], list[list]]:
    """Every request added at once and stepped to completion: each one's tokens, and each step's
    events (request id, token count)."""
    seqs = [engine.add_request(p, params) for p, params in requests]
    steps = []
    while engine.has_work():
        steps.append([(e.request_id, len(e.token_ids)) for e in engine.step()])
        assert len(steps) < 2000
    return [s.output_ids for s in seqs], steps


def run_watching_chunks(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]):
    """Every request added at once and stepped to completion: each one's tokens, and the length of
    every prefill chunk of every step."""
    seqs = [engine.add_request(p, params) for p, params in requests]
    lens = []
    while engine.has_work():
        engine.step()
        lens += [s.prefill_end - s.prefill_start for s in engine.scheduler.chunks]
        assert len(lens) < 2000
    return [s.output_ids for s in seqs], lens


@pytest.mark.parametrize("budget", [5, 7, 13])
@pytest.mark.parametrize("caching", [True, False], ids=["cached", "uncached"])
def test_chunked_prefill_decodes_what_one_prefill_per_prompt_decodes(tiny, budget, caching):
    """Budgets of 5, 7 and 13 tokens cut the prompts (6 to 50 tokens, pages of 4) inside pages and
    across them; a shared prefix comes back from the cache in the middle of a chunked prompt."""
    requests = [(p, GREEDY if i % 2 else SEEDED) for i, p in enumerate(PROMPTS)]
    requests.append((PROMPTS[0][:30] + [7, 7, 7], GREEDY))  # shares 30 tokens with the first
    whole = new_engine(tiny, max_num_seqs=8, kv_page_size=PAGE, enable_prefix_caching=caching)
    chunked = new_engine(
        tiny, max_num_seqs=8, kv_page_size=PAGE, enable_prefix_caching=caching, max_num_batched_tokens=budget
    )
    expected, _ = run(whole, requests)
    got, steps = run(chunked, requests)
    assert got == expected
    assert chunked.stats.prefill_steps > whole.stats.prefill_steps


@pytest.mark.parametrize(("budget", "threshold"), [(1000, 5), (13, 7), (9, 3)])
@pytest.mark.parametrize("caching", [True, False], ids=["cached", "uncached"])
def test_paced_prefill_decodes_what_one_prefill_per_prompt_decodes(tiny, budget, threshold, caching):
    """Thresholds of 3, 5 and 7 tokens (pages of 4) cut the prompts inside pages and across them,
    with a budget that would hold every prompt at once and with budgets that cut them too; the
    prompt that shares 30 tokens with the first has only its own left to pace."""
    requests = [(p, GREEDY if i % 2 else SEEDED) for i, p in enumerate(PROMPTS)]
    requests.append((PROMPTS[0][:30] + [7, 7, 7], GREEDY))
    whole = new_engine(tiny, max_num_seqs=8, kv_page_size=PAGE, enable_prefix_caching=caching)
    paced = new_engine(
        tiny,
        max_num_seqs=8,
        kv_page_size=PAGE,
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
    )
    expected, _ = run(whole, requests)
    got, chunk_lens = run_watching_chunks(paced, requests)
    assert got == expected
    assert max(chunk_lens) == threshold and min(chunk_lens) < threshold  # paced, and some prompts end short of it


def test_running_requests_decode_every_step_while_a_long_prompt_goes_in(tiny):
    """With a budget of 8, a 50-token prompt takes at least 7 steps to prefill, and the request that
    runs meanwhile gets a token at every one of them; the long one's first token comes after its
    last chunk."""
    engine = new_engine(tiny, max_num_seqs=4, kv_page_size=PAGE, max_num_batched_tokens=8)
    running = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.step()
    long = engine.add_request(PROMPTS[3], GREEDY)
    steps = 0
    while not long.output_ids:
        events = {e.request_id: len(e.token_ids) for e in engine.step()}
        steps += 1
        assert events[running.request_id] == 1
    assert steps >= -(-50 // 7)
    while engine.has_work():
        engine.step()
    assert long.output_ids == run(new_engine(tiny, max_num_seqs=1), [(PROMPTS[3], GREEDY)])[0][0]


def test_a_sequence_preempted_between_its_chunks_decodes_what_it_decodes_alone(tiny):
    """A pool of 20 pages of 4 tokens: decodes run out of pages while prompts are still going in,
    so sequences are preempted (some between two chunks) and prefilled again later."""
    requests = [(p, GREEDY) for p in PROMPTS]
    engine = new_engine(tiny, max_num_seqs=4, kv_page_size=PAGE, kv_cache_tokens=20 * PAGE, max_num_batched_tokens=9)
    got, _ = run(engine, requests)
    assert engine.scheduler.num_preempted > 0
    for (prompt, params), tokens in zip(requests, got):
        assert tokens == run(new_engine(tiny, max_num_seqs=1), [(prompt, params)])[0][0]


def test_chunked_prefill_with_lora_adapters(tiny, tmp_path):
    """Chunks of a request read its adapter's slot like a whole prefill does."""
    adapter = adapter_for(tiny.model_dir, tmp_path / "a", seed=1)
    limits = LoraLimits(max_loras=2, max_lora_rank=8)
    requests = [(PROMPTS[0], GREEDY), (PROMPTS[3], GREEDY)]

    def with_adapter(budget: int) -> list[list[int]]:
        engine = new_engine(tiny, max_num_seqs=4, kv_page_size=PAGE, lora=limits, max_num_batched_tokens=budget)
        seqs = [
            engine.add_request(p, params, adapter=("a", str(adapter)) if i == 0 else None)
            for i, (p, params) in enumerate(requests)
        ]
        while engine.has_work():
            engine.step()
        return [s.output_ids for s in seqs]

    assert with_adapter(6) == with_adapter(1000)


def config(model_dir: str, budget: int, threshold: int = 0) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        max_num_seqs=4,
        max_model_len=64,
        device="cpu",
        kv_page_size=PAGE,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
    )


def _serve(rank: int, port: int, arg: tuple[str, int]) -> dict:
    model_dir, threshold = arg
    engine = rank_engine(rank, port, config(model_dir, budget=7, threshold=threshold))
    if engine is None:
        return {}
    outputs, _ = run(engine, [(p, GREEDY) for p in PROMPTS[:4]])
    engine.stop_followers()
    return {"outputs": outputs}


@pytest.mark.parametrize("threshold", [0, 3], ids=["unpaced", "paced"])
def test_two_ranks_prefill_the_same_chunks(tmp_path, monkeypatch, threshold):
    """Rank 0 ships each chunk as a prefill of its own (the followers plan nothing, paced or not):
    two ranks chunking decode what one process decodes without chunks."""
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    model_dir = str(default_model_dir())
    results = start_two_ranks((model_dir, threshold), work=_serve)
    engine, _ = LLMEngine.from_config(config(model_dir, budget=1000))
    assert results[0]["outputs"] == run(engine, [(p, GREEDY) for p in PROMPTS[:4]])[0]
