"""Causal attention for a prefill: whole prompts packed end to end, each attending to itself only.

On CUDA in bf16/fp16 one variable-length flash-attention call per layer covers every prompt of the
step (`torch.nn.attention.varlen`). Elsewhere (CPU, fp32, a torch without it) each prompt gets its
own SDPA call. The single call matters under a burst of arrivals: a prefill of many short prompts
is launch-bound, and one attention call per prompt per layer made its cost grow with the number of
prompts rather than their tokens.
"""

from __future__ import annotations

import inspect
from itertools import accumulate

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch before 2.10
    varlen_attn = None

# The signature moved between torch releases: causality as `is_causal` or as `window_size`, GQA
# native (`enable_gqa`) or not.
_VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()
_PACKED_DTYPES = (torch.bfloat16, torch.float16)


class PackedPrompts:
    """Where each prompt starts in the packed tokens; built once per prefill, used by every layer."""

    def __init__(self, seq_lens: list[int], device: torch.device) -> None:
        self.max_len = max(seq_lens)
        self.starts = torch.tensor([0, *accumulate(seq_lens)], dtype=torch.int32, device=device)


def packed_supported(x: torch.Tensor, window: int | None) -> bool:
    """Whether one varlen call can serve a prefill whose activations are like `x` (device, dtype)."""
    if varlen_attn is None or not x.is_cuda or x.dtype not in _PACKED_DTYPES:
        return False
    return "window_size" in _VARLEN_PARAMS or (not window and "is_causal" in _VARLEN_PARAMS)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prompts: PackedPrompts, window: int | None
) -> torch.Tensor:
    """q (tokens, heads, dim), k/v (tokens, kv_heads, dim) -> (tokens, heads * dim), one call."""
    kwargs = {}
    if "enable_gqa" in _VARLEN_PARAMS:
        kwargs["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if "window_size" in _VARLEN_PARAMS:
        kwargs["window_size"] = (window - 1 if window else -1, 0)  # (left, right): causal, windowed if set
    else:
        kwargs["is_causal"] = True
    out = varlen_attn(q, k, v, prompts.starts, prompts.starts, prompts.max_len, prompts.max_len, **kwargs)
    return out.reshape(q.shape[0], -1)


def per_prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], window: int | None
) -> torch.Tensor:
    """The same result with one SDPA call per prompt."""
    outs = []
    for qs, ks, vs in zip(q.split(seq_lens), k.split(seq_lens), v.split(seq_lens)):
        n = qs.shape[0]
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (qs, ks, vs))
        if window and n > window:
            i = torch.arange(n, device=qs.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        outs.append(o[0].transpose(0, 1).reshape(n, -1))
    return torch.cat(outs)
