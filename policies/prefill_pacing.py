"""How much of a prompt one engine step prefills: a long prompt's prefill paced over steps.

A step carries at most `max_num_batched_tokens` tokens. Without pacing, a prompt takes whatever of
that the decodes and the prompts before it leave, so a long prompt fills whole steps until it is in,
and every running stream waits a full-budget step for each of its tokens meanwhile. With
`long_prefill_token_threshold` (vLLM's name for the same rule) a prompt with more than that left to
prefill gets at most that many tokens a step: its prefill is spread over more, lighter steps (its
own TTFT grows), and the rest of the budget stays for the prompts behind it. Pure, so the rule is
tested on its own; the scheduler (`workers/serving/scheduler.py`) applies it to every chunk.
"""

from __future__ import annotations


def chunk_tokens(still_to_prefill: int, budget_left: int, long_prefill_token_threshold: int = 0) -> int:
    """This step's chunk of a prompt with `still_to_prefill` tokens left (positions found in the
    prefix cache or written by earlier chunks do not count) when `budget_left` tokens of the step
    are free: all of them if they fit, never more than the budget left, and at most the threshold
    when it is > 0 (0: off, the prompt takes what the budget leaves)."""
    if long_prefill_token_threshold > 0:
        budget_left = min(budget_left, long_prefill_token_threshold)
    return min(still_to_prefill, budget_left)
