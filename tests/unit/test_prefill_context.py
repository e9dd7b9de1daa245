"""Prefill after a cached prefix (workers/kv/prefill_attention.py, LlamaModel.prefill): queries of
only the uncached tokens, keys of the whole context read back from the pages, give the rows a full
prefill gives; with a sliding window too; mixed with prompts that have no cached context."""

import pytest
import torch

from workers.kv.prefill_attention import PackedPrompts, per_prompt_attention
from workers.modeling.config import parse_config
from workers.modeling.model import LlamaModel

HEADS, KV_HEADS, DIM = 4, 2, 8


def qkv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))


@pytest.mark.parametrize("window", [None, 5])
def test_the_uncached_tail_attends_as_the_full_prompt_does(window):
    lens, contexts = [11, 6, 9], [8, 0, 4]  # a cached context, none, and one shorter than the window's reach
    full = [qkv(n + c, seed) for seed, (n, c) in enumerate(zip(lens, contexts))]
    whole = [per_prompt_attention(q, k, v, [len(q)], window) for q, k, v in full]
    q = torch.cat([fq[c:] for (fq, _, _), c in zip(full, contexts)])
    k = torch.cat([fk for _, fk, _ in full])  # every key of each prompt: its context, then its new tokens
    v = torch.cat([fv for _, _, fv in full])
    tail = per_prompt_attention(q, k, v, lens, window, contexts)
    expected = torch.cat([w[c:] for w, c in zip(whole, contexts)])
    torch.testing.assert_close(tail, expected, rtol=1e-5, atol=1e-6)


def test_key_positions_name_each_prompts_slot_from_position_zero():
    prompts = PackedPrompts([3, 2], torch.device("cpu"), context_lens=[4, 0])
    slots, positions = prompts.key_positions(torch.tensor([7, 7, 7, 2, 2]))
    assert slots.tolist() == [7] * 7 + [2] * 2
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert prompts.key_starts.tolist() == [0, 7, 9] and prompts.max_keys == 7 and prompts.max_len == 3


def tiny_model() -> LlamaModel:
    cfg = parse_config(
        dict(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            torch_dtype="float32",
        )
    )
    model = LlamaModel(cfg, 64)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0.0, 0.2, generator=g)
    return model.eval()


@torch.inference_mode()
def test_a_prefill_after_cached_pages_gives_the_logits_of_a_full_prefill():
    model = tiny_model()
    cache = model.make_kv_cache(num_slots=2, page_size=4)
    cache.set_pages([0, 0, 1, 0, 1, 2, 0, 2, 3, 0, 3, 4, 1, 0, 5, 1, 1, 6, 1, 2, 7, 1, 3, 8])
    prompt = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(1))
    n = len(prompt)
    full = model.prefill(prompt, torch.arange(n), torch.full((n,), 1), [n], cache)
    # slot 0: the first 8 positions (two pages) prefilled alone, then the last 5 after them
    model.prefill(prompt[:8], torch.arange(8), torch.zeros(8, dtype=torch.long), [8], cache)
    tail = model.prefill(
        prompt[8:], torch.arange(8, n), torch.zeros(n - 8, dtype=torch.long), [n - 8], cache, None, [8]
    )
    torch.testing.assert_close(tail, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(tail.argmax(-1), full.argmax(-1))
