"""When prompts that arrived while others decode start their prefill: at once, or gathered.

A step that prefills makes every running stream wait for that prefill, and a prefill call costs
about the same whether it carries a few tokens or a few hundred (the model's weights are read
either way, and launched layer by layer). Requests that reach a busy engine one at a time (a burst
through the serving path arrives over a few hundred milliseconds, each request admitted by the
replica in turn) are each prefilled in a call of their own, and the running streams pay one stall
per arrival. With `max_prefill_delay_ms` they wait up to that long to be prefilled together: one
call, one stall. No one waits when nothing decodes (the prefill stalls no stream), when a prompt's
prefill is under way this step anyway (the newcomers ride with it), or once the waiting prompts
would fill the step's token budget. Pure: the scheduler (`workers/serving/scheduler.py`) asks it
each step.
"""

from __future__ import annotations


def wave_due(
    decoding: int, prefilling: bool, oldest_wait_s: float, waiting_tokens: int, budget: int, max_delay_s: float
) -> bool:
    """Whether the waiting prompts start their prefill this step. `decoding`: sequences that decode
    this step; `prefilling`: whether some prompt's chunk is prefilled this step already;
    `oldest_wait_s`: how long the queue's head has waited; `waiting_tokens`: the waiting prompts'
    tokens; `budget`: the step's prompt tokens left; `max_delay_s` 0: never wait."""
    return decoding == 0 or prefilling or oldest_wait_s >= max_delay_s or waiting_tokens >= budget
