"""Our model against transformers' own implementation on the same checkpoint (fp32, CPU).

Each test writes a checkpoint with transformers, loads it with `workers.modeling.checkpoint.load_model`, and
compares logits of prefill and of greedy decode steps. Any mismatch in weight loading, fused
projections, RoPE (and its scalings), GQA, biases, tied embeddings or the sliding window shows up as
a relative error far above the 1e-4 tolerance.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.kv_pages import assign_pages, poison, slot_kv
from tests.unit.conftest import make_hf_checkpoint
from workers.modeling.checkpoint import load_model

VOCAB = 300
MAX_LEN = 128
PROMPT_LEN = 20
DECODE_STEPS = 32
RTOL = 1e-4

CONFIGS = {
    "llama": ("llama", {}),
    "llama-tied-llama3-rope": (
        "llama",
        dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "mistral-sliding-window": ("mistral", dict(sliding_window=8)),
    "qwen2-qkv-bias": ("qwen2", {}),
}


def hf_forward(hf, ids: torch.Tensor, cache=None):
    """One HF forward over `ids` (1-D) continuing `cache`; returns (last-position logits, new cache).
    transformers 5.x renamed `past_key_values` to `cache`; use whichever this version has."""
    new_name = "cache" in inspect.signature(hf.forward).parameters
    kwargs = {"cache" if new_name else "past_key_values": cache} if cache is not None else {}
    out = hf(input_ids=ids[None], use_cache=True, **kwargs)
    return out.logits[0, -1], out.cache if new_name else out.past_key_values


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


def prefill_one(model, prompt: torch.Tensor, cache, slot: int = 0, adapter: int | None = None) -> torch.Tensor:
    """Prefill a single prompt into `slot` (with LoRA slot `adapter`); returns its last-token
    logits, shape (vocab,)."""
    n = prompt.numel()
    slots = torch.full((n,), slot, dtype=torch.long)
    adapters = None if adapter is None else torch.full((n,), adapter)
    return model.prefill(prompt, torch.arange(n), slots, [n], cache, adapters)[0]


@pytest.fixture
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (PROMPT_LEN, 5, 13)]


@pytest.mark.parametrize("model_type, extra", CONFIGS.values(), ids=CONFIGS.keys())
@torch.no_grad()
def test_prefill_and_greedy_decode_match_transformers(tmp_path, model_type, extra, prompts):
    """Prefill logits and 32 greedy decode steps equal the HF model's (rel. error <= 1e-4, same tokens)."""
    # Seed 1 gives a non-degenerate greedy run (several distinct tokens) for every config.
    hf = make_hf_checkpoint(tmp_path, model_type, seed=1, **extra)
    ours = load_model(tmp_path, max_model_len=MAX_LEN)
    assert ours.cfg.dtype == torch.float32
    cache = ours.make_kv_cache(2)
    assign_pages(cache)
    prompt = prompts[0]

    ref, past = hf_forward(hf, prompt)
    got = prefill_one(ours, prompt, cache)
    assert rel_err(got, ref) <= RTOL, "prefill logits differ"

    ours_tokens, ref_tokens = [], []
    for step in range(DECODE_STEPS):
        tok_ref, tok = ref.argmax(), got.argmax()
        ref_tokens.append(tok_ref.item())
        ours_tokens.append(tok.item())
        assert tok == tok_ref, f"greedy token differs at step {step}"
        pos = PROMPT_LEN + step
        ref, past = hf_forward(hf, tok_ref.view(1), past)
        got = ours.decode(tok.view(1), torch.tensor([pos]), torch.tensor([0]), cache)[0]
        assert rel_err(got, ref) <= RTOL, f"decode logits differ at step {step} (position {pos})"
    assert ours_tokens == ref_tokens
    # The greedy run should not be degenerate, or "same tokens" would prove little.
    assert len(set(ref_tokens)) > 1


@torch.no_grad()
def test_batched_prefill_matches_each_prompt_alone(tmp_path, prompts):
    """Three prompts of different lengths packed in one prefill call (three slots) give each prompt's
    own last-token logits, equal to HF on that prompt alone, and write each slot's K/V as alone."""
    hf = make_hf_checkpoint(tmp_path, "llama")
    ours = load_model(tmp_path, max_model_len=MAX_LEN)
    slots = [2, 0, 3]
    lens = [p.numel() for p in prompts]

    batched = ours.make_kv_cache(4)
    assign_pages(batched)
    poison(batched, {})
    tokens = torch.cat(prompts)
    positions = torch.cat([torch.arange(n) for n in lens])
    slot_ids = torch.cat([torch.full((n,), s, dtype=torch.long) for s, n in zip(slots, lens)])
    logits = ours.prefill(tokens, positions, slot_ids, lens, batched)
    assert logits.shape == (3, VOCAB)

    for i, (prompt, slot, n) in enumerate(zip(prompts, slots, lens)):
        ref, _ = hf_forward(hf, prompt)
        assert rel_err(logits[i], ref) <= RTOL, f"prompt {i} differs from HF"
        alone = ours.make_kv_cache(4)
        assign_pages(alone, seed=i + 1)  # other pages than the batched cache's
        assert torch.allclose(logits[i], prefill_one(ours, prompt, alone, slot), rtol=1e-5, atol=1e-5)
        for got, want in zip(slot_kv(batched, slot, n), slot_kv(alone, slot, n)):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


DECODE_CONFIGS = {k: CONFIGS[k] for k in ("llama", "mistral-sliding-window")}


@pytest.mark.parametrize("model_type, extra", DECODE_CONFIGS.values(), ids=DECODE_CONFIGS.keys())
@torch.no_grad()
def test_batched_decode_reads_only_its_own_slot_and_length(tmp_path, prompts, model_type, extra):
    """Three sequences at different lengths, decoded together in one call per step (slots 3, 0, 1),
    equal each sequence decoded alone, even with every cache entry outside a row's own slot and
    length (other slots, the scratch slot, positions past its end) filled with 1e4-scale garbage."""
    make_hf_checkpoint(tmp_path, model_type, **extra)
    ours = load_model(tmp_path, max_model_len=MAX_LEN)
    slots = torch.tensor([3, 0, 1])
    lens = [p.numel() for p in prompts]
    steps = 12

    # Each sequence alone, in a clean cache of its own, in slot 0.
    alone_logits = []
    for prompt in prompts:
        cache = ours.make_kv_cache(1)
        assign_pages(cache)
        logits = [prefill_one(ours, prompt, cache)]
        for step in range(steps):
            tok, pos = logits[-1].argmax().view(1), torch.tensor([prompt.numel() + step])
            logits.append(ours.decode(tok, pos, torch.tensor([0]), cache)[0])
        alone_logits.append(torch.stack(logits))

    # All three together, after prefilling each into its slot of a poisoned cache.
    cache = ours.make_kv_cache(4)
    assign_pages(cache, seed=5)
    poison(cache, {})
    last = torch.stack([prefill_one(ours, p, cache, int(s)) for p, s in zip(prompts, slots)])
    poison(cache, {int(s): n for s, n in zip(slots, lens)})  # garbage everywhere but written K/V
    positions = torch.tensor(lens)
    for step in range(steps):
        tokens = last.argmax(-1)
        last = ours.decode(tokens, positions + step, slots, cache)
        for i in range(3):
            torch.testing.assert_close(last[i], alone_logits[i][step + 1], rtol=1e-5, atol=1e-5)
