"""Which attention serves a prefill call whose prompts have a cached context: flash attention over
the context gathered from the pages, or the paged decode kernel with every new token a row.

Flash attention gives a call one program per query head and block of queries, each walking every
key in turn: its cost follows the context, hardly the new tokens. The paged kernel spreads the
keys over the SMs, but each new token reads its whole context (its cost follows tokens x context),
and its three launches a layer cost more host time than flash's one. Measured per call on the
H200 (`bench/results/cached_prefill_attention_h200.md`, 1B and 8B shapes): the paged kernel took
0.35-0.79x flash's time for 2 to 32 tokens over 8,000 cached ones, 0.60-0.86x on the 8B over 4,096
(about even on the 1B there), and lost with 64 tokens or more, contexts of 2,000 or less, or a
single token (flash's one-query case is cheap). Host-timed calls vary by ~25% between runs.
"""

from __future__ import annotations

PAGED_MIN_TOKENS = 2  # one new token: flash attention's one-query case is as cheap
PAGED_MAX_TOKENS = 32  # more new tokens: each rereads the context, flash reads it once
PAGED_MIN_CONTEXT = 4096  # shorter contexts: flash's walk is short, the kernel's launches are not


def paged_prefill_pays(tokens: int, context_lens: list[int]) -> bool:
    """Whether a call of `tokens` new tokens in all, over prompts with these cached contexts, is
    cheaper as rows of the paged decode kernel."""
    return PAGED_MIN_TOKENS <= tokens <= PAGED_MAX_TOKENS and min(context_lens) >= PAGED_MIN_CONTEXT
