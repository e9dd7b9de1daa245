"""Prefill graphs (workers/graphs/prefill_graphs.py, workers/model_runner/prefill_pieces.py), on CPU:
the pieces between attention calls, run on padded static buffers, compute what the plain prefill
computes (several prompts, cached contexts, padding that never reaches a real slot); an engine whose
prefills replay (the CPU stand-in of capture) decodes token for token what an engine without prefill
graphs decodes, through chunked prefill, prefix-cache hits and preemption, and where short prefills
run as rows of the decode step; denied requests, prompts above the ladder and faulty graphs run
eager, each with its reason. The GPU tests capture real graphs
(tests/gpu/test_prefill_graphs_cuda.py)."""

from __future__ import annotations

import pytest
import torch

import workers.serving.engine
from policies.dispatch import FallbackReason
from policies.graph_policy import GraphPolicy, default_prefill_buckets
from tests.prefill_batches import packed, random_prompts, run_staggered
from tests.unit.engine_fixtures import load_tiny, new_engine
from tests.unit.graph_faults import EagerGraphRunner, EagerPrefillGraphs, piece_reads_the_next_token
from workers.model_runner.prefill_pieces import PrefillPieces
from workers.model_runner.step_inputs import PrefillInputs
from workers.serving.sampling import SamplingParams

BUCKETS = (16, 32, 48)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(tmp_path_factory)


def give_pages(cache, slots: list[int], lens: list[int]) -> None:
    """Distinct pages (from 1) for each slot's positions 0 .. len - 1."""
    edits, page = [], 1
    for slot, n in zip(slots, lens):
        for index in range(-(-n // cache.page_size)):
            edits += [slot, index, page]
            page += 1
    cache.set_pages(edits)


def plain_prefill(model, cache, batch: PrefillInputs) -> torch.Tensor:
    tokens, positions, slots, _ = batch.to_device(torch.device("cpu"))
    return model.prefill(tokens, positions, slots, batch.lens, cache, None, batch.context_lens)


@torch.inference_mode()
@pytest.mark.parametrize("contexts", [[0, 0, 0], [16, 0, 5]])
def test_the_pieces_on_a_padded_bucket_compute_the_plain_prefill(tiny, contexts):
    """Three prompts (one with a cached context of a whole page, one of part of a page) packed into
    a bucket with padding: the same logits and the same K/V in every real slot as the plain prefill,
    and nothing written outside the scratch page but the prompts' own positions."""
    model = tiny.model
    prompts = random_prompts([21, 7, 12], model.cfg.vocab_size, seed=1)
    slots = [2, 0, 3]
    results = []
    for use_pieces in (False, True):
        cache = model.make_kv_cache(4)
        give_pages(cache, slots, [len(p) for p in prompts])
        if any(contexts):  # the cached contexts: written by a plain prefill of just them
            cached = [(p[:c], s) for p, s, c in zip(prompts, slots, contexts) if c]
            plain_prefill(model, cache, packed([p for p, _ in cached], [s for _, s in cached], [0] * len(cached)))
        batch = packed(prompts, slots, contexts)
        if use_pieces:
            pieces = PrefillPieces(model, cache, max(BUCKETS))
            pieces.inputs.fill_(7)  # stale values a bucket's padding must overwrite
            logits = pieces.run(batch, bucket=48)
            assert len(batch.tokens) < 48
        else:
            logits = plain_prefill(model, cache, batch)
        results.append((logits, cache.k[:, 1:].clone(), cache.v[:, 1:].clone()))
    (plain, k_plain, v_plain), (pieces_logits, k_pieces, v_pieces) = results
    torch.testing.assert_close(pieces_logits, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_pieces, k_plain, rtol=1e-5, atol=1e-6)  # every page but the scratch page
    torch.testing.assert_close(v_pieces, v_plain, rtol=1e-5, atol=1e-6)


def prefill_graph_engine(tiny, monkeypatch, faults=None, capture_prefill=True, decode_buckets=(1, 2, 4), **config):
    """An engine whose graphs are the CPU stand-ins; its prefills replay the stand-in's pieces or
    its decode step (unless `capture_prefill` is false: then only its decode steps replay)."""

    def runner(model, cache, policy, lora=False, prefill_buckets=()):
        made = EagerGraphRunner(model, cache, policy, lora=lora, prefill_buckets=prefill_buckets)
        if faults and made.prefill_graphs is not None:
            made.prefill_graphs = EagerPrefillGraphs(model, cache, prefill_buckets, faults)
        return made

    monkeypatch.setattr(workers.serving.engine, "GraphRunner", runner)
    policy = GraphPolicy(
        decode_batch_buckets=decode_buckets, prefill_token_buckets=BUCKETS, capture_prefill=capture_prefill
    )
    return new_engine(tiny, graph_policy=policy, **config)


def prefill_parts(engine) -> dict[tuple[str, str, str], int]:
    return {
        (p["execution_mode"], p["bucket_id"], p["fallback_reason"]): p["steps"]
        for p in engine.status().stats["prefill_step_parts"]
    }


@pytest.mark.parametrize("chunk", [None, 24])
def test_an_engine_replaying_prefill_graphs_decodes_what_one_without_them_does(tiny, monkeypatch, chunk):
    """Staggered arrivals, greedy and seeded sampling, prompts sharing a cached prefix, one prompt
    above the largest bucket (eager, shape_miss), chunked prefill with chunk boundaries inside
    prompts and pages (budget 24), and a request denied graphs (its batches run the eager twin)."""
    vocab = tiny.model.cfg.vocab_size
    shared = random_prompts([20], vocab, seed=5)[0]
    prompts = random_prompts([5, 13, 9, 31, 17, 3], vocab, seed=2)
    # the last arrives alone, and prefills only the 6 tokens after the page it shares with the first
    prompts += [shared + [1, 2, 3], random_prompts([55], vocab, seed=9)[0], shared + [4, 5]]
    params = [
        SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    config = dict(max_num_seqs=4) | ({"max_num_batched_tokens": chunk} if chunk else {})
    expected = run_staggered(
        prefill_graph_engine(tiny, monkeypatch, capture_prefill=False, **config), prompts, params, 2
    )
    engine = prefill_graph_engine(tiny, monkeypatch, **config)
    graphs = engine.runner.prefill_graphs
    assert graphs.table.ready == {b for b in BUCKETS if b <= (chunk or 64)}
    before = sum(graphs.replayed.values())  # start-up's verification and warm-up replay too
    assert run_staggered(engine, prompts, params, 2, denied=frozenset({3})) == expected
    parts = prefill_parts(engine)
    replayed = sum(n for (mode, _, _), n in parts.items() if mode == "piecewise")
    assert replayed > 0 and sum(graphs.replayed.values()) - before == replayed
    assert any(reason == "tenant_disabled" and mode == "eager" for mode, _, reason in parts)
    if chunk is None:  # the 55-token prompt is above the largest bucket
        assert ("eager", "none", "shape_miss") in parts
        assert engine.stats.prefix_hits_tokens == 16


def test_short_prefills_replay_the_decode_step_with_a_row_per_token(tiny, monkeypatch):
    """Prefills of at most a decode bucket's rows run as rows of the decode step: prompts of a few
    tokens, a follow-up whose new tokens attend to a cached prefix across pages, and a request
    denied graphs (the step's eager twin). Greedy and seeded, they decode what prefills through the
    prefill path decode (fp32); longer prefills keep to that path."""
    vocab = tiny.model.cfg.vocab_size
    shared = random_prompts([37], vocab, seed=6)[0]
    prompts = random_prompts([3, 5, 2, 12, 4], vocab, seed=3) + [shared, shared + [7, 8, 9]]
    params = [
        SamplingParams(max_tokens=5, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    # with async scheduling too: a row whose last token is in flight leaves the budget to the prompts
    config = dict(max_num_seqs=8, max_num_batched_tokens=40, decode_buckets=(1, 2, 4, 8))
    plain = prefill_graph_engine(tiny, monkeypatch, capture_prefill=False, **config)
    expected = run_staggered(plain, prompts, params, 1, denied=frozenset({4}))
    assert not any(bucket.startswith("decode_bs") for _, bucket, _ in prefill_parts(plain))
    engine = prefill_graph_engine(tiny, monkeypatch, **config)
    before = sum(engine.runner.replayed.values())
    assert run_staggered(engine, prompts, params, 1, denied=frozenset({4})) == expected
    parts = prefill_parts(engine)
    # one prompt a step: 3, 5 and 2 tokens as rows of buckets 4, 8 and 2; 12 through the prefill
    # graphs; 4 denied graphs on the step's eager twin; 37 above the prefill ladder under a budget
    # of 40 (16, 32); the follow-up's 8 tokens after its 32 cached ones (two pages) on bucket 8
    assert parts == {
        ("cuda_graph", "decode_bs_4", "none"): 1,
        ("cuda_graph", "decode_bs_8", "none"): 2,
        ("cuda_graph", "decode_bs_2", "none"): 1,
        ("piecewise", "prefill_tokens_16", "none"): 1,
        ("eager", "decode_bs_4", "tenant_disabled"): 1,
        ("eager", "none", "shape_miss"): 1,
    }
    decode_rows = sum(n for (mode, b, _), n in parts.items() if mode == "cuda_graph" and b.startswith("decode_bs"))
    assert sum(engine.runner.replayed.values()) - before == engine.stats.decode_steps + decode_rows
    assert engine.stats.prefix_hits_tokens == 32


def test_a_prefill_bucket_whose_replay_differs_from_its_eager_twin_is_withdrawn(tiny, monkeypatch):
    engine = prefill_graph_engine(tiny, monkeypatch, faults={32: piece_reads_the_next_token})
    graphs = engine.runner.prefill_graphs
    assert graphs.table.ready == {16, 48}
    reason, detail = graphs.table.missing[32]
    assert reason == FallbackReason.VERIFY_MISMATCH and "graph - eager" in detail
    report = engine.status().prefill_buckets
    assert report["prefill_tokens_32"]["fallback_reason"] == "verify_mismatch"
    assert report["prefill_tokens_16"]["ready"] and report["prefill_tokens_16"]["verify_max_abs_diff"] == 0.0
    prompts = random_prompts([25], tiny.model.cfg.vocab_size, seed=4)
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
    plain = prefill_graph_engine(tiny, monkeypatch, capture_prefill=False)
    expected = run_staggered(plain, prompts, params, 2)
    assert run_staggered(engine, prompts, params, 2) == expected  # bucket 32 runs eager, right
    assert ("eager", "none", "verify_mismatch") in prefill_parts(engine)


def test_the_policys_prefill_ladder():
    assert default_prefill_buckets(8192) == (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)
    assert default_prefill_buckets(1000) == (16, 32, 64, 128, 256, 512, 768, 1000)
    assert default_prefill_buckets(8) == (8,)
    assert GraphPolicy(prefill_token_buckets=(8, 64, 4096)).prefill_buckets(2048) == (8, 64)
    assert GraphPolicy(capture_prefill=False).prefill_buckets(2048) == ()
    assert GraphPolicy(mode="eager").prefill_buckets(2048) == ()
    with pytest.raises(ValueError, match="strictly increasing"):
        GraphPolicy(prefill_token_buckets=(64, 32))


def test_a_cpu_engine_prefills_eager_and_says_why(tiny):
    engine = new_engine(tiny)
    run_staggered(engine, [[1, 2, 3]], [SamplingParams(max_tokens=2, ignore_eos=True)], 1)
    assert prefill_parts(engine) == {("eager", "none", "unavailable"): 1}
    assert all(not b["ready"] for b in engine.status().prefill_buckets.values())
