"""Causal attention for a prefill: prompts packed end to end, each attending to itself only.

On CUDA in bf16/fp16 one variable-length flash-attention call per layer covers every prompt of the
step: torch's FlashAttention-2 op itself, which takes fewer KV heads than query heads (GQA) as
they are. Elsewhere (CPU, fp32, a GPU without FlashAttention-2) each prompt gets its own SDPA call.
The single call matters under a burst of arrivals: a prefill of many short prompts is launch-bound,
and one attention call per prompt per layer made its cost grow with the number of prompts rather
than their tokens. The op is called directly, not through `torch.nn.attention.varlen`: that
wrapper (torch 2.11) copies K/V to every query head first and costs ~0.1 ms of host time a call,
16 to 32 calls a prefill, which prefill graphs (`prefill_pieces.py`) otherwise leave as the
prefill's host cost (`bench/results/prefill_profile_h200.md`).

A prompt whose first positions are cached (prefix caching) brings only its other tokens' queries;
its keys and values are its whole context, read back from its pages after the layer wrote the new
ones (`key_positions`). Query i of such a prompt sits at position context + i and sees keys up to
there: the causal diagonal aligned to the keys' end. Flash attention's causal mask is aligned that
way when queries and keys differ in length (what torch's `causal_lower_right` relies on); the SDPA
path builds that mask itself (SDPA's own `is_causal` aligns to the start).

A call of few new tokens over a long cached context (a short follow-up turn of a long chat) is a
decode in all but name. Flash attention gives it one program per query head, walking every key in
turn, after the context is gathered out of the pages; the paged decode kernel
(`paged_attention.py`), every new token a row of length position + 1, spreads the keys over the
SMs and reads them in place. `policies/cached_prefill.py` says when that pays, by measurement.
"""

from __future__ import annotations

import functools
from itertools import accumulate

import torch
import torch.nn.functional as F

from policies.cached_prefill import paged_prefill_pays
from workers.kv import paged_attention
from workers.kv.kv_cache import KVCache

_PACKED_DTYPES = (torch.bfloat16, torch.float16)


class PackedPrompts:
    """Where each prompt starts in the packed queries and in the packed keys (which also hold its
    cached context, if any); built once per prefill, used by every layer."""

    def __init__(self, seq_lens: list[int], device: torch.device, context_lens: list[int] | None = None) -> None:
        self.max_len = max(seq_lens)
        # copies that do not wait for the device, as `torch.tensor(values, device=cuda)` would
        self.starts = torch.tensor([0, *accumulate(seq_lens)], dtype=torch.int32).to(device, non_blocking=True)
        self.key_lens = [c + n for c, n in zip(context_lens, seq_lens)] if context_lens else list(seq_lens)
        self.max_keys = max(self.key_lens)
        self.key_starts = self.starts
        if context_lens:
            key_starts = torch.tensor([0, *accumulate(self.key_lens)], dtype=torch.int32)
            self.key_starts = key_starts.to(device, non_blocking=True)

    def key_positions(self, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, position) of every key, packed: per prompt its slot at positions 0 .. context +
        len - 1. On the device, no host sync: the sizes are known on the host."""
        total = sum(self.key_lens)
        repeats = torch.tensor(self.key_lens).to(slot_ids.device, non_blocking=True)
        slots = torch.repeat_interleave(slot_ids[self.starts[:-1].long()], repeats, output_size=total)
        first = torch.repeat_interleave(self.key_starts[:-1].long(), repeats, output_size=total)
        return slots, torch.arange(total, device=slot_ids.device) - first


@functools.cache
def _flash_device(index: int) -> bool:
    """FlashAttention-2 runs on Ampere (sm_80) and newer."""
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(index) >= (8, 0)


def packed_supported(x: torch.Tensor, window: int | None) -> bool:
    """Whether one varlen call can serve a prefill whose activations are like `x` (device, dtype;
    any window: flash takes it)."""
    return x.is_cuda and x.dtype in _PACKED_DTYPES and _flash_device(x.device.index or 0)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prompts: PackedPrompts, window: int | None
) -> torch.Tensor:
    """q (tokens, heads, dim), k/v (keys, kv_heads, dim) -> (tokens, heads * dim), one call; causal,
    within the last `window` positions if set."""
    out = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        prompts.starts,
        prompts.key_starts,
        prompts.max_len,
        prompts.max_keys,
        0.0,  # dropout
        True,  # causal, aligned to the keys' end
        False,  # no debug mask
        window_size_left=window - 1 if window else -1,
        window_size_right=0 if window else -1,
    )[0]
    return out.reshape(q.shape[0], -1)


def visible_keys(tokens: int, context: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(tokens, context + tokens): query i, at position context + i, sees the keys at positions up
    to its own (and within the sliding window, if any)."""
    query = torch.arange(context, context + tokens, device=device)[:, None]
    key = torch.arange(context + tokens, device=device)[None, :]
    visible = key <= query
    if window:
        visible &= key > query - window
    return visible


def per_prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: list[int],
    window: int | None,
    context_lens: list[int] | None = None,
) -> torch.Tensor:
    """The same result with one SDPA call per prompt; with `context_lens`, k/v hold each prompt's
    cached context before its new tokens."""
    context_lens = context_lens or [0] * len(seq_lens)
    key_lens = [c + n for c, n in zip(context_lens, seq_lens)]
    outs = []
    for qs, ks, vs, context in zip(q.split(seq_lens), k.split(key_lens), v.split(key_lens), context_lens):
        n = qs.shape[0]
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (qs, ks, vs))
        if context or (window and n > window):
            mask = visible_keys(n, context, window, qs.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        outs.append(o[0].transpose(0, 1).reshape(n, -1))
    return torch.cat(outs)


def paged_supported(like: torch.Tensor, tokens: int, context_lens: list[int] | None) -> bool:
    """Whether the paged decode kernel serves a call of `tokens` new tokens: it runs here, and
    over these cached contexts it pays."""
    return (
        bool(context_lens) and like.is_cuda and paged_attention.available() and paged_prefill_pays(tokens, context_lens)
    )


class PrefillAttention:
    """One prefill's attention, set up once for all its layers: how its prompts are packed, and
    where a prompt with a cached context finds its keys (read back from its pages after each layer
    writes its new ones, or read in place by the paged kernel). `slot_ids` and `positions`: each
    token's slot and position; `like`: a tensor of the activations' device and dtype, which decide
    whether one packed call can serve every prompt."""

    def __init__(
        self,
        cache: KVCache,
        slot_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        context_lens: list[int] | None,
        window: int | None,
        like: torch.Tensor,
    ) -> None:
        self.cache = cache
        self.seq_lens = seq_lens
        self.window = window
        self.context = context_lens if context_lens and any(context_lens) else None
        self.slot_ids = slot_ids
        self.plan = None
        if paged_supported(like, len(slot_ids), self.context):
            kv_heads, head_dim = cache.k.shape[-2:]
            self.plan = paged_attention.paged_decode_plan(positions + 1, window, kv_heads, head_dim)
            self.packed, self.prompts, self.keys_at = False, None, None
            return
        self.packed = packed_supported(like, window)
        prompts = PackedPrompts(seq_lens, like.device, self.context) if self.packed or self.context else None
        self.prompts = prompts
        self.keys_at = cache.write_index(*prompts.key_positions(slot_ids)) if self.context else None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer's attention of the new tokens' q (tokens, heads, dim) over their own k/v (their
        cached context's too): (tokens, heads * dim)."""
        if self.plan is not None:  # each token a decode row, over the pages the layer has just written
            cache = self.cache
            return paged_attention.paged_decode(
                q, cache.k[layer], cache.v[layer], cache.block_table, self.slot_ids, *self.plan
            )
        if self.keys_at is not None:  # this layer's new K/V are in the pages now, after the cached ones
            k, v = self.cache.read(layer, self.keys_at)
        if self.packed:
            return packed_attention(q, k, v, self.prompts, self.window)
        return per_prompt_attention(q, k, v, self.seq_lens, self.window, self.context)
