"""Packed prefill attention (one varlen flash call for all prompts) against one SDPA call per prompt,
on the GPU: prompts of odd lengths, GQA, with and without a sliding window."""

import pytest
import torch

from workers.kv.prefill_attention import PackedPrompts, packed_attention, packed_supported, per_prompt_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_equals_per_prompt(window, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [1, 7, 33, 130, 5]
    heads, kv_heads, dim = 8, 2, 64
    q, k, v = (
        torch.randn(sum(lens), h, dim, device="cuda", dtype=dtype, generator=g) for h in (heads, kv_heads, kv_heads)
    )
    assert packed_supported(q, window)  # the fast path really runs on this device and torch
    packed = packed_attention(q, k, v, PackedPrompts(lens, q.device), window)
    reference = per_prompt_attention(q, k, v, lens, window)
    assert packed.shape == reference.shape == (sum(lens), heads * dim)
    torch.testing.assert_close(packed.float(), reference.float(), atol=2e-2, rtol=2e-2)


def test_fp32_takes_the_per_prompt_path():
    q = torch.zeros(4, 2, 8, device="cuda")
    assert not packed_supported(q, None)
