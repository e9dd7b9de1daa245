"""Which prefill calls run as rows of the decode step: every new token a row at its own position,
in its sequence's slot, attending to the positions up to its own (those before it are in its pages
or written by the rows before it in the same layer).

A prefill of a few new tokens is a decode in all but name. Run as rows of the captured decode step,
it is one graph replay; through the prefill path it is a replay per layer's pieces and an attention
call between them, bound by their launches. Each row reads its whole context where flash attention
reads it once, so the rows' key reads (tokens x context) bound the rule. Measured per call on the
H200 (`bench/results/prefill_rows_h200.md`, 1B and 8B shapes, contexts 0 to 8,000): rows took
0.55-0.95x the prefill path's time for 1 to 32 tokens at every context, 0.73-0.93x for 48 and 64
tokens over contexts up to 2,000, 0.81-0.96x for 128 tokens over 512 or none, and lost from 48
tokens over 8,000 on the 8B (1.03-1.12x) and with 128 tokens over 2,000 or more (0.99-1.72x). The
bound on key reads draws that line; every measured call it sends to rows was faster as rows.

Where the decode step cannot replay (no captured bucket holds the tokens, eager mode, a CPU), a
call's attention alone may still run on the paged decode kernel (`paged_prefill_pays`). Flash
attention gives a call one program per query head and block of queries, each walking every key in
turn: its cost follows the context, hardly the new tokens. The paged kernel spreads the keys over
the SMs, but each new token reads its whole context, and its three launches a layer cost more
host time than flash's one. Measured per call on the H200
(`bench/results/cached_prefill_attention_h200.md`, 1B and 8B shapes): the paged kernel took
0.35-0.79x flash's time for 2 to 32 tokens over 8,000 cached ones, 0.60-0.86x on the 8B over 4,096
(about even on the 1B there), and lost with 64 tokens or more, contexts of 2,000 or less, or a
single token (flash's one-query case is cheap). Host-timed calls vary by ~25% between runs.
"""

from __future__ import annotations

DECODE_ROWS_MAX_TOKENS = 128  # 0.95x at 128 tokens over no context: more rows would gain little
DECODE_ROWS_MAX_KEY_READS = 1 << 18  # sum of tokens x their context: 32 tokens over 8,000 still pay
PAGED_MIN_TOKENS = 2  # one new token: flash attention's one-query case is as cheap
PAGED_MAX_TOKENS = 32  # more new tokens: each rereads the context, flash reads it once
PAGED_MIN_CONTEXT = 4096  # shorter contexts: flash's walk is short, the kernel's launches are not


def prefill_as_decode_rows(lens: list[int], context_lens: list[int]) -> bool:
    """Whether a prefill call of sequences with `lens` new tokens after `context_lens` cached ones
    runs as a row a token of the decode step, where a captured decode bucket holds them."""
    reads = sum(n * (c + n) for n, c in zip(lens, context_lens, strict=True))
    return 1 <= sum(lens) <= DECODE_ROWS_MAX_TOKENS and reads <= DECODE_ROWS_MAX_KEY_READS


def paged_prefill_pays(tokens: int, context_lens: list[int]) -> bool:
    """Whether a call of `tokens` new tokens in all, over prompts with these cached contexts, is
    cheaper as rows of the paged decode kernel."""
    return PAGED_MIN_TOKENS <= tokens <= PAGED_MAX_TOKENS and min(context_lens) >= PAGED_MIN_CONTEXT
