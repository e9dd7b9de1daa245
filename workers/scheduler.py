"""Continuous-batching bookkeeping: which sequences wait, which run, which KV slot each owns.

Pure Python (no torch) so admission and slot reuse are testable in microseconds. Sequences join the
running batch between steps and leave it the moment they finish; a freed slot is reused by the next
admission. Each step's prompt tokens are bounded so a burst of long prompts cannot stall decoding.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from policies.dispatch import FallbackReason
from workers.sampling import InvalidRequest, SamplingParams


class QueueFull(RuntimeError):
    """No room to queue another request now (the serving layer's 503: try again later)."""


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    graph_denial: FallbackReason | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def new_sequence(
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str | None = None,
    graph_denial: FallbackReason | None = None,
) -> Sequence:
    """A request's state; unseeded requests get a random seed of their own here. A request with a
    graph_denial (its tenant's reason) is never decoded by a graph replay."""
    seed = params.seed % (1 << 63) if params.seed is not None else random.getrandbits(63)
    return Sequence(request_id or uuid.uuid4().hex, list(prompt_ids), params, seed, graph_denial=graph_denial)


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit, checkable wherever requests arrive (also outside the engine's process)."""

    max_model_len: int
    vocab_size: int | None  # when set, prompt ids outside [0, vocab_size) are rejected
    capacity: int  # requests held at most: every slot busy and max_waiting more in line

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_ids) > self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        # an out-of-range id would fail inside the batched step and take every request down with it
        if self.vocab_size is not None and not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size})")


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_waiting: int,
        max_prefill_tokens: int,
        vocab_size: int | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.limits = RequestLimits(max_model_len, vocab_size, max_num_seqs + max_waiting)
        self.max_prefill_tokens = max_prefill_tokens
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest first
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.limits.check_prompt(seq.prompt_ids)
        if self.find(seq.request_id) is not None:
            raise InvalidRequest(f"request id {seq.request_id!r} is already in use")
        if self.num_unfinished >= self.limits.capacity:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting (max_waiting={self.max_waiting})")
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots, first come first served, within the step's
        prompt-token budget (the first admission always fits so a long prompt cannot starve)."""
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            if admitted and len(seq.prompt_ids) > budget:
                break
            self.waiting.popleft()
            budget -= len(seq.prompt_ids)
            seq.slot = self.free_slots.pop()
            self.running[seq.request_id] = seq
            admitted.append(seq)
        return admitted

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if self.running.pop(seq.request_id, None) is not None:
            self.free_slots.append(seq.slot)
            self.free_slots.sort(reverse=True)
        else:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        if request_id in self.running:
            return self.running[request_id]
        return next((s for s in self.waiting if s.request_id == request_id), None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
