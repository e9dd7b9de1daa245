"""Structured outputs: JSON schemas compiled (with llguidance) into one grammar matcher per sequence,
whose token bitmask the sampler applies after the replayed step.

A schema is known by its canonical JSON (`json_schema.py`: compact, key order kept: the order of `properties` is the
order the object is written in, so two orderings are two grammars). The compiled grammar is cached
per engine (LRU by that text) and compiled in a thread of its own, never on the step loop:
llguidance drops the interpreter lock while it builds a grammar. A sequence gets a copy of the
cached matcher (microseconds) and advances it by every token it draws; a continuation from another
engine (failover) replays the tokens its client already has into its copy first.

JSON is written compactly, as `json.dumps` does (`", "` and `": "`, no other whitespace): a small
model given free whitespace may never leave it. End-of-sequence tokens are allowed only where the
grammar may end, and a sequence whose grammar is complete ends there (finish reason `stop`).

A mask costs what llguidance's walk of the token trie costs, which depends on where the grammar is:
a few microseconds almost everywhere (a free string is a precomputed slice of the vocabulary), a
fraction of a millisecond inside a string near its `maxLength`, where each token's length is
checked against what is left (`bench/mask_cost.py`). The masks of a batch with many
constrained rows are filled ahead (`MaskFiller.start`): in a thread of the filler's own, as soon as
the grammars have taken the step's tokens, while the engine ends that step and prepares and
launches the next; llguidance holds no interpreter lock while it fills, and the sampler waits only
where it applies them. On a host of 8 cores or more the fill runs on llguidance's pool of
`FILL_THREADS`. Its copies of one matcher share their parser state behind one lock (a pool filled
32 copies no faster than one thread), so a schema is compiled into LINEAGES matchers apart
(`CompiledSchema`), 4 per thread, and a sequence copies one of them in turn: on 16 cores a pool of 8
filled 32 matchers compiled apart in half the time one thread took, and the engine's fill ahead of
32 rows took half as long (`bench/results/mask_fill_scaling_*`, `structured_output_lineages_*`).
Below 8 cores the fill stays on one thread (on 2, a pool filled 4x slower).
The masks are as wide as the tokenizer's vocabulary, not the model's logits: the padded columns
past it are banned by the apply without a bit of their own.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict

import llguidance
import torch

from workers.serving.grammar_tokenizer import grammar_tokenizer
from workers.serving.json_schema import CACHE_SIZE, InvalidSchema, grammar_of
from workers.serving.sampling import InvalidRequest

COMPILE_THREADS = 4  # llguidance compiles without the interpreter lock
STRING_CHARACTER = r'[^"\\\x00-\x1F\x7F]'  # a JSON string's characters written without an escape
# The vocabulary's slices: llguidance's own (`LLTokenizer.general_slices()`: whitespace, string runs
# of at most 10 and 30 characters, any run) with bounds 12 to 24 added. A mask takes the tokens of a
# slice whose every string is allowed at once and walks the token trie for the others: inside a
# string with 12-29 characters left before its `maxLength` only the 10 fit whole, and such a mask
# took ~100 µs; with these, 5-8 µs from 16 left and ~60 µs at 12-15, bit for bit the same mask
# (`bench/mask_cost.py`). The tokenizer's one-time set-up (compile thread) takes ~50 ms more.
SLICES = [
    r"[\x20\x0A\x0D\x09]+",
    *(f"{STRING_CHARACTER}{{1,{n}}}" for n in (10, 12, 16, 20, 24, 30)),
    f"{STRING_CHARACTER}+",
]


def fill_threads(cores: int) -> int:
    """llguidance threads a fill ahead runs on (and lineages a schema is compiled into)."""
    return 1 if cores < 8 else min(8, cores // 2)


FILL_THREADS = fill_threads(len(os.sched_getaffinity(0)))
LINEAGES = 4 * FILL_THREADS if FILL_THREADS > 1 else 1  # matchers compiled apart per schema (`CompiledSchema`)


def reason(matcher: llguidance.LLMatcher) -> str:
    """Why a matcher failed: the first line of its error (the rest is its parser's state)."""
    return matcher.get_error().split("\n", 1)[0]


class Grammar:
    """One sequence's place in its grammar; `words`: the int32 words of its token bitmask; `filled`:
    the bitmask row its mask for the place it is at was last written to (-1: none since it moved)."""

    __slots__ = ("matcher", "words", "filled", "lineage")

    def __init__(self, matcher: llguidance.LLMatcher, words: int, lineage: int = 0) -> None:
        self.matcher = matcher
        self.words = words
        self.filled = -1
        self.lineage = lineage  # the compiled matcher it was copied from (`CompiledSchema`)

    def accept(self, token: int) -> bool:
        """Advance by a drawn token; False if the grammar does not allow it (never for a masked draw)
        or failed before it: a schema whose document cannot go on (a `$ref` loop met mid-way) fails
        when its next mask is computed, and then allows only end-of-sequence, which would end an
        unfinished document as if it were complete."""
        self.filled = -1
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    def replay(self, tokens: list[int]) -> None:
        """Advance by the tokens a continuation's client already has; InvalidRequest if they do not fit."""
        self.filled = -1
        if tokens and not self.matcher.consume_tokens(tokens):
            raise InvalidRequest(f"cannot continue this stream: its tokens do not fit its schema ({self.error})")

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and cannot go on (its sequence ends here)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return reason(self.matcher)


class CompiledSchema:
    """A schema's grammar as matchers compiled apart, its lineages: a sequence copies one of them, in
    turn. Copies of one share their parser state (and its lock), copies of two do not, so a pool
    fills rows of different lineages at once. The first is compiled and checked before any
    sequence starts; the others are added as they are compiled, in the background."""

    __slots__ = ("matchers", "_turn", "retired")

    def __init__(self, first: llguidance.LLMatcher) -> None:
        self.matchers = [first]
        self._turn = 0
        self.retired = False  # out of its compiler's cache, or the compiler closed: no more lineages

    def copy(self) -> tuple[llguidance.LLMatcher, int]:
        """A new sequence's matcher, and the lineage it was copied from."""
        lineage = self._turn % len(self.matchers)
        self._turn += 1
        return self.matchers[lineage].deep_copy(), lineage


class GrammarCompiler:
    """One engine's grammars: compiled for its tokenizer, cached, off the step loop.

    The llguidance tokenizer (about 0.2 s for 49k tokens, and ~0.15 s to check its reading of
    every token against the tokenizer's: `grammar_tokenizer.py`) is built on the first compile, in
    the compile thread, so an engine that never serves a schema never pays for it. `vocab_size` is the
    model's logits width: the masks need not cover it. Ids past the tokenizer's (a padded
    vocabulary: 128256 logits over a 49152-token tokenizer in the benchmark) have no bytes and are
    never allowed, and the apply bans every column past a mask's words, so a mask has a bit only
    for the tokenizer's ids (and the end-of-sequence ids): at 49152 of 128256, 2.6x fewer words to
    fill, copy to the device and read."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], vocab_size: int, cache_size: int = CACHE_SIZE):
        self.hf_tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = max(len(tokenizer), max(eos_token_ids, default=-1) + 1)
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | InvalidSchema | None = None
        self._cache: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        # several: one schema that takes seconds to compile does not hold up the others' requests
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="graphserve-grammar")
        # the lineages after the first, on a thread of their own: a request's compile never queues
        # behind them (a schema's lineages are LINEAGES - 1 compiles, 31 on 16 cores)
        self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphserve-grammar-lineages")
        self._lock = threading.Lock()  # the tokenizer is built once, whichever thread asks first

    @property
    def mask_words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.vocab_size + 31) // 32

    def compile(self, schema: str) -> concurrent.futures.Future:
        """The compiled grammar of a canonical schema, as a future (done at once when cached): its
        result is a CompiledSchema, its exception an InvalidSchema."""
        future = self._cache.get(schema)
        if future is not None:
            self._cache.move_to_end(schema)
            return future
        future = self._pool.submit(self._compile, schema)
        self._cache[schema] = future
        if len(self._cache) > self.cache_size:
            _, evicted = self._cache.popitem(last=False)
            evicted.add_done_callback(_retire)
        return future

    def _compile(self, schema: str) -> CompiledSchema:
        """Its first lineage, checked; the others are compiled next, in the background, one after
        another."""
        compiled = CompiledSchema(self._matcher(schema))
        if LINEAGES > 1:
            try:
                self._background.submit(self._lineages, schema, compiled)
            except RuntimeError:  # closed meanwhile: no sequence will copy it
                pass
        return compiled

    def _lineages(self, schema: str, compiled: CompiledSchema) -> None:
        """The other lineages, while this compile of the schema is cached: one evicted meanwhile is
        compiled anew by the next request that names it, so more lineages of it would never be copied."""
        while len(compiled.matchers) < LINEAGES and not compiled.retired:
            compiled.matchers.append(self._matcher(schema))

    def _matcher(self, schema: str) -> llguidance.LLMatcher:
        """A matcher, its first mask computed on a copy: a schema no document satisfies (a `$ref`
        to itself) fails there, here rather than in a sequence, and the first mask's lazy set-up is
        done off the step loop."""
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar_of(schema), log_level=0)
        if matcher.is_error():
            raise InvalidSchema(f"the JSON schema cannot be compiled: {reason(matcher)}")
        probe, row = matcher.deep_copy(), torch.empty(self.mask_words, dtype=torch.int32)  # row: alive while written
        probe.unsafe_compute_mask_ptr(row.data_ptr(), self.mask_words * 4)
        if probe.is_error():
            raise InvalidSchema(f"no document satisfies the JSON schema ({reason(probe)})")
        return matcher

    def tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (`grammar_tokenizer`), or the InvalidSchema saying why there
        is none, built once."""
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = grammar_tokenizer(
                        self.hf_tokenizer, self.vocab_size, list(self.eos_token_ids), SLICES
                    )
                except InvalidSchema as e:
                    self._tokenizer = e
            if isinstance(self._tokenizer, InvalidSchema):
                raise InvalidSchema(str(self._tokenizer))
            return self._tokenizer

    def grammar(self, compiled: CompiledSchema) -> Grammar:
        """A sequence's own grammar state, at its start."""
        matcher, lineage = compiled.copy()
        return Grammar(matcher, self.mask_words, lineage)

    def close(self) -> None:
        """Stop compiling (the lineage being compiled ends; no other starts)."""
        for future in self._cache.values():
            future.add_done_callback(_retire)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._background.shutdown(wait=False, cancel_futures=True)


def _retire(future: concurrent.futures.Future) -> None:
    """A compile that left the cache: its lineages not compiled yet never will be."""
    if not future.cancelled() and future.exception() is None:
        future.result().retired = True


class MaskFiller:
    """Fills the token bitmasks of grammars on the host, one row after another: now (`fill`), or
    ahead, in a thread of its own (`start`; then `wait` before the masks are read or those grammars
    touched: llguidance holds each matcher for the fill, and another call on one meanwhile raises)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._executor: llguidance.LLExecutor | None = None  # made by the first fill ahead
        self._pid = os.getpid()  # a forked child has neither the fill thread nor the executor's
        self._jobs: queue.SimpleQueue | None = None  # to the fill thread, started by the first `start`
        self._done = threading.Lock()  # held while a fill runs in the thread
        self._outcome: list[BaseException] = []  # what it raised
        self._seconds: list[float] = [0.0]  # how long it took, written by the fill thread
        self._pending = False

    @property
    def last_fill_s(self) -> float:
        """How long the last fill ahead that ended took."""
        return self._seconds[0]

    @property
    def executor(self) -> llguidance.LLExecutor:
        """llguidance's executor of FILL_THREADS: a fill ahead is one call for the batch, so the fill
        thread takes the interpreter lock once a fill, not once a row against the step loop's Python."""
        if self._pid != os.getpid():
            self._reset()
        if self._executor is None:
            self._executor = llguidance.LLExecutor(FILL_THREADS)
        return self._executor

    def fill(self, grammars: list[Grammar], bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
        """Now, on this thread: row rows[i] (default i) of `bitmask` (a contiguous host int32 tensor)
        gets grammar i's allowed tokens."""
        start, row_bytes = bitmask.data_ptr(), bitmask.shape[1] * 4
        rows = range(len(grammars)) if rows is None else rows
        for g, r in zip(grammars, rows):  # addresses: a tensor view per row costs microseconds
            g.matcher.unsafe_compute_mask_ptr(start + r * row_bytes, row_bytes)

    def start(self, pairs: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor) -> None:
        """In the fill thread, row r of `bitmask` gets matcher m's allowed tokens for each (m, r) of
        `pairs` (in lineage order: the pool gives each thread a run of neighbours); returns at once
        (after any fill still running)."""
        self.wait()
        executor = self.executor
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_fill_thread, args=(self._jobs,), name="graphserve-masks", daemon=True).start()
            weakref.finalize(self, self._jobs.put, None)  # the thread ends with its filler
        self._done.acquire()
        self._pending = True
        self._jobs.put((executor, pairs, bitmask, self._done, self._outcome, self._seconds))

    def wait(self) -> None:
        """Until the fill started last has ended; raises what it raised."""
        if not self._pending or self._pid != os.getpid():
            return
        self._done.acquire()
        self._done.release()
        self._pending = False
        if self._outcome:
            raise self._outcome.pop()


def _fill_thread(jobs: queue.SimpleQueue) -> None:
    """A filler's thread: one batch call a job (llguidance drops the interpreter lock while it
    fills), `done` released when it has ended. Holds no reference to its filler."""
    while (job := jobs.get()) is not None:
        _run_fill(*job)
        del job  # the matchers and the buffer: not held past their fill


def _run_fill(
    executor: llguidance.LLExecutor,
    pairs: list,
    bitmask: torch.Tensor,
    done: threading.Lock,
    outcome: list,
    seconds: list[float],
) -> None:
    start = time.perf_counter()
    try:
        executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
    except BaseException as e:  # raised where the step waits for it
        outcome.append(e)
    finally:
        seconds[0] = time.perf_counter() - start
        done.release()
