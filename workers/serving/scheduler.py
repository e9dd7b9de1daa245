"""Continuous-batching bookkeeping: which sequences wait, which run, which KV pages each holds.

Pure Python (no torch) so admission, paging and preemption are testable in microseconds. Sequences
join the running batch between steps and leave it the moment they finish. A running sequence owns a
slot (its row of the block table; there are max_num_seqs, the batch limit) and the pages the block
manager gave it; admission needs a free slot and free pages for the whole sequence so far. When a
decode step needs pages the pool no longer has, the newest sequences are preempted: their pages are
freed and they go back to the front of the queue with every token kept, to be prefilled again
(prompt and output so far) when pages are free. Every page given out is also recorded as a
block-table edit (slot, index, page) for the engine to hand to the device (`take_edits`).

Chunked prefill: a step carries the running decodes plus at most `max_num_batched_tokens` tokens in
all, so a long prompt cannot stall the running streams for its whole prefill. What is left after
one token per decoding sequence goes to prompts, first to those already partly prefilled, then to
new admissions; a prompt longer than what is left is prefilled in chunks over several steps (its
positions before the chunk are in its pages, as a cached prefix is), and decodes only once its
last chunk is in. With `long_prefill_token_threshold` > 0 a prompt with more than that left gets at
most that many tokens a step (`policies/prefill_pacing.py`), so its prefill is spread over steps and
the rest of the budget goes to the prompts behind it.

With prefix caching, each sequence's full pages are named by a hash chain of its tokens salted with
its adapter (`policies/prefix_hash.py`): an admitted sequence reuses the cached pages of its prefix
and its prefill starts after them (`prefill_start`); its own full pages become cached as they are
written, the prompt's at admission, the rest as decode steps fill them.
"""

from __future__ import annotations

import random
import time
import uuid
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from policies.dispatch import FallbackReason
from policies.kv_blocks import BlockManager
from policies.prefill_pacing import chunk_tokens
from policies.prefill_waves import wave_due
from policies.prefix_hash import page_hashes
from workers.serving.sampling import InvalidRequest, SamplingParams

if TYPE_CHECKING:
    from workers.serving.grammar import Grammar


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
    adapter: tuple[str, str] | None = None  # the LoRA adapter it asked for: (name, path)
    adapter_slot: int = 0  # the LoRA slot its rows read; 0: none (or not granted yet)
    cache_salt: bytes | None = b""  # what its KV depends on beyond its tokens; None: not known yet
    page_hashes: list[bytes] = field(default_factory=list)  # chain hashes of its full pages so far
    prefill_start: int = 0  # positions its next prefill finds in its pages (cached, or earlier chunks)
    prefill_end: int = 0  # where this step's prefill chunk of it ends
    in_prefill: bool = False  # admitted, and its prompt not all prefilled yet: it does not decode
    cached_tokens: int | None = None  # prompt tokens its first prefill found cached (usage)
    grammar: Grammar | None = None  # its response_format's matcher, once compiled (`grammar.py`)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        """Every token so far: what a prefill writes, the first time and after a preemption."""
        return self.prompt_ids + self.output_ids


def new_sequence(
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str | None = None,
    graph_denial: FallbackReason | None = None,
    adapter: tuple[str, str] | None = None,
    output_ids: Iterable[int] = (),
) -> Sequence:
    """A request's state; unseeded requests get a random seed of their own here. A request with a
    graph_denial (its tenant's reason) is never decoded by a graph replay. A request continued from
    another engine starts with the tokens it had there (output_ids): its prefill writes them after
    the prompt and its next token is sampled at their count, the step it was at."""
    seed = params.seed % (1 << 63) if params.seed is not None else random.getrandbits(63)
    return Sequence(
        request_id or uuid.uuid4().hex,
        list(prompt_ids),
        params,
        seed,
        list(output_ids),
        graph_denial=graph_denial,
        adapter=adapter,
        cache_salt=b"" if adapter is None else None,  # an adapter's salt names its load: set when granted
    )


def _ids_within(ids: list[int], vocab_size: int) -> bool:
    """Whether every id is an integer in [0, vocab_size). In C (an int64 array, then its min and
    max): checked once per request in the replica and again in the engine, where a loop over a long
    prompt's ids cost more than the rest of its admission."""
    try:
        packed = array("q", ids)
    except (TypeError, OverflowError):  # a float, a string, an id past 64 bits
        return False
    return min(packed) >= 0 and max(packed) < vocab_size


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
        if self.vocab_size is not None and not _ids_within(prompt_ids, self.vocab_size):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt")

    def check_params(self, params: SamplingParams) -> None:
        """A logit_bias token outside the vocabulary would fail the batched step, as a prompt id would."""
        if self.vocab_size is not None and any(token >= self.vocab_size for token, _ in params.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be in [0, {self.vocab_size})", "logit_bias")

    def check_continuation(self, prompt_ids: list[int], output_ids: list[int], max_tokens: int) -> None:
        """A request continued with the tokens it had elsewhere must be one that engine could have
        been running: valid ids, and room for at least one more token."""
        if not output_ids:
            return
        self.check_prompt([*prompt_ids, *output_ids])
        if len(prompt_ids) + len(output_ids) >= self.max_model_len or len(output_ids) >= max_tokens:
            raise InvalidRequest(f"a continuation after {len(output_ids)} tokens has no token left to generate")


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_waiting: int,
        max_num_batched_tokens: int,
        vocab_size: int | None = None,
        blocks: BlockManager | None = None,
        prefix_caching: bool = False,
        long_prefill_token_threshold: int = 0,
        max_prefill_delay_s: float = 0.0,
    ) -> None:
        """Without `blocks`, a pool of 16-token pages that holds every slot at max_model_len.
        `prefix_caching`: reuse cached full pages of a prompt's prefix. `long_prefill_token_threshold`:
        the most prompt tokens one sequence prefills in a step; 0: as many as the budget leaves.
        `max_prefill_delay_s`: how long prompts arriving while others decode may wait to be
        prefilled together (`policies/prefill_waves.py`); 0: never."""
        self.blocks = blocks or BlockManager(1 + max_num_seqs * -(-max_model_len // 16), 16)
        if self.blocks.capacity_tokens < max_model_len:
            raise ValueError(
                f"a KV pool of {self.blocks.capacity_tokens} tokens cannot hold one sequence of "
                f"max_model_len={max_model_len}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.limits = RequestLimits(max_model_len, vocab_size, max_num_seqs + max_waiting)
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.max_num_batched_tokens = max_num_batched_tokens
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {long_prefill_token_threshold}")
        self.long_prefill_token_threshold = long_prefill_token_threshold
        if max_prefill_delay_s < 0:
            raise ValueError(f"max_prefill_delay_s must be >= 0, got {max_prefill_delay_s}")
        self.max_prefill_delay_s = max_prefill_delay_s
        self.prefix_caching = prefix_caching
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest first
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # in admission order: the oldest first
        self.prefilling: dict[str, Sequence] = {}  # running ones with prompt left to prefill, oldest first
        self.chunks: list[Sequence] = []  # the sequences the last `admit` gave a prefill chunk this step
        self.edits: list[int] = []
        self.num_preempted = 0

    def add(self, seq: Sequence) -> None:
        self.limits.check_prompt(seq.prompt_ids)
        self.limits.check_params(seq.params)
        self.limits.check_continuation(seq.prompt_ids, seq.output_ids, seq.params.max_tokens)
        if self.find(seq.request_id) is not None:
            raise InvalidRequest(f"request id {seq.request_id!r} is already in use")
        if self.num_unfinished >= self.limits.capacity:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting (max_waiting={self.max_waiting})")
        self.waiting.append(seq)

    def admit(
        self,
        ready: Callable[[Sequence], bool] = lambda seq: True,
        now: float | None = None,
        idle: Set[str] = frozenset(),
    ) -> list[Sequence]:
        """Plan this step's prefill (`chunks`, each from its prefill_start to its prefill_end) within
        the token budget: the chunks of sequences partly prefilled go on first, then waiting
        sequences move into free slots, first come first served, while the pool has pages for them
        and for what the running batch needs this step (a sequence's tokens so far plus the one its
        first decode writes). Tokens and pages found in the prefix cache count for neither. With
        `long_prefill_token_threshold` set no chunk is longer, and what a long prompt leaves of the
        budget goes to those behind it. At least one page's worth of prompt (or the threshold, if
        smaller) goes in every step, however many decode. `ready(seq)` may hold the queue's head
        back (its LoRA adapter has no slot yet) or end it (`finish`) before it runs. While others
        decode, waiting prompts may be held back to be prefilled together (`max_prefill_delay_s`;
        `now`: the monotonic time, default the clock's). The `idle` running sequences (the engine's,
        whose last token is drawn already) decode no more: they take neither budget nor a page. Returns the
        sequences admitted now. The caller prefills every chunk in this step (the full pages they
        write are cached from now on); a sequence whose last chunk it is samples its first token
        and decodes in this step too."""
        for seq in self.chunks:  # the last step's chunks are in their pages now
            seq.prefill_start = seq.prefill_end
        self.chunks = []
        admitted: list[Sequence] = []
        if not self.prefilling and (not self.waiting or not self.free_slots):
            return admitted  # the common step: nothing to prefill, so no pass over the running batch
        decoding = len(self.running) - len(self.prefilling) - len(idle)
        budget = max(self.max_num_batched_tokens - decoding, min(self.blocks.page_size, self.max_num_batched_tokens))
        for seq in list(self.prefilling.values()):
            if budget <= 0:
                break
            budget -= self._plan_chunk(seq, budget)
        if self.waiting and self.max_prefill_delay_s and not self._wave_due(decoding, budget, now):
            return admitted
        reserve = sum(
            self.blocks.needs_page(s.request_id)
            for s in self.running.values()
            if not s.in_prefill and s.request_id not in idle
        )
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting[0]
            hits = self.blocks.cached_prefix(seq.length, self._hashes(seq))
            if self.blocks.pages_taken(hits, min(seq.length + 1, self.max_model_len)) + reserve > self.blocks.num_free:
                break
            if not ready(seq):
                if self.waiting and self.waiting[0] is seq:
                    break
                continue
            self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            # hashed again: a salt known only once `ready` granted the adapter finds no fewer pages
            self._edit(seq.slot, 0, self.blocks.allocate(seq.request_id, seq.length, self._hashes(seq), written=0))
            seq.prefill_start = self.blocks.cached_tokens(seq.request_id)
            if seq.cached_tokens is None:
                seq.cached_tokens = min(seq.prefill_start, len(seq.prompt_ids))
            seq.in_prefill = True
            self.prefilling[seq.request_id] = seq
            budget -= self._plan_chunk(seq, budget)
            reserve += self.blocks.needs_page(seq.request_id)
            self.running[seq.request_id] = seq
            admitted.append(seq)
        return admitted

    def _wave_due(self, decoding: int, budget: int, now: float | None) -> bool:
        waited = (time.monotonic() if now is None else now) - self.waiting[0].arrival_time
        waiting_tokens = sum(s.length for s in self.waiting)
        return wave_due(decoding, bool(self.chunks), waited, waiting_tokens, budget, self.max_prefill_delay_s)

    def _plan_chunk(self, seq: Sequence, budget: int) -> int:
        """Give seq this step's chunk: as much of its prompt as `budget` and the pacing threshold
        allow. The full pages the chunk completes become cached now (this step's prefill writes them
        before any reader's attention reads them). Returns the chunk's token count."""
        still_to_prefill = seq.length - seq.prefill_start
        seq.prefill_end = seq.prefill_start + chunk_tokens(still_to_prefill, budget, self.long_prefill_token_threshold)
        self.chunks.append(seq)
        if seq.prefill_end == seq.length:  # its last chunk: it samples its first token and decodes this step
            seq.in_prefill = False
            self.prefilling.pop(seq.request_id, None)
        hashes = self._hashes(seq)
        page_size = self.blocks.page_size
        for index in range(seq.prefill_start // page_size, min(len(hashes), seq.prefill_end // page_size)):
            self.blocks.cache_page(seq.request_id, index, hashes[index])
        return seq.prefill_end - seq.prefill_start

    def _hashes(self, seq: Sequence) -> list[bytes]:
        """The chain hashes of seq's full pages (extended as it grows); none without prefix
        caching or while its salt is unknown (then it is admitted as if nothing were cached)."""
        if not self.prefix_caching or seq.cache_salt is None:
            return []
        if len(seq.page_hashes) < seq.length // self.blocks.page_size:
            seq.page_hashes = page_hashes(seq.token_ids, self.blocks.page_size, seq.cache_salt, seq.page_hashes)
        return seq.page_hashes

    def reserve_decode(self, idle: Set[str] = frozenset()) -> list[Sequence]:
        """Room for one more position of every running sequence but those `idle` this step (the
        engine's, whose last token is drawn already). Returns the sequences preempted for it
        (newest first): they are back at the front of the queue, oldest first."""
        preempted, grown = self.blocks.reserve_step(
            list(self.running), (self.prefilling.keys() | idle) if idle else self.prefilling.keys()
        )
        for request_id in grown:
            pages = self.blocks.block_table(request_id)
            self._edit(self.running[request_id].slot, len(pages) - 1, pages[-1:])
        out = []
        for request_id in preempted:
            seq = self.running.pop(request_id)
            self._release_slot(seq)
            self.waiting.appendleft(seq)  # its prefill starts over (after what is cached) when admitted again
            out.append(seq)
        self.num_preempted += len(out)
        if self.prefix_caching:
            self._cache_filled_pages()
        return out

    def _cache_filled_pages(self) -> None:
        """The pages this step's decode fills (its write is a page's last position) become cached."""
        page_size = self.blocks.page_size
        for seq in self.running.values():
            if seq.length % page_size == 0 and seq.cache_salt is not None and not seq.in_prefill:
                hashes = self._hashes(seq)
                self.blocks.cache_page(seq.request_id, len(hashes) - 1, hashes[-1])

    def take_edits(self) -> list[int]:
        """Block-table edits since the last call, as flat (slot, index, page) triples."""
        edits, self.edits = self.edits, []
        return edits

    def _edit(self, slot: int, start: int, pages: list[int]) -> None:
        for i, page in enumerate(pages, start):
            self.edits += (slot, i, page)

    def _release_slot(self, seq: Sequence) -> None:
        self.blocks.free(seq.request_id)
        self.prefilling.pop(seq.request_id, None)
        seq.in_prefill = False
        self.free_slots.append(seq.slot)
        self.free_slots.sort(reverse=True)
        seq.slot = -1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if self.running.pop(seq.request_id, None) is not None:
            self._release_slot(seq)
        else:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        if request_id in self.running:
            return self.running[request_id]
        return next((s for s in self.waiting if s.request_id == request_id), None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
