"""Captures the decode step as CUDA graphs, one per batch-size bucket, and replays them; the plain
runner's prefills too, per bucket of token counts (`prefill_graphs.py`).

The model calls and their static inputs are the model runner's (`model_runner/runner.py`): each
step copies the live batch into the static inputs, padding rows pointing at the KV cache's scratch
slot. A runner made with `lora=True` captures the step with the LoRA deltas (`lora.py`); one
without, the plain step, which costs nothing extra for batches that use no adapter. The block
table itself is a static input too: it changes in place, by the step's edits, before the copy.
Capture happens before the engine is READY: warm-up on a side stream (which compiles the step,
once for every bucket, when the policy compiles: `compiled_step.py`), then buckets largest first
into one shared memory pool with the garbage collector quiet (`capture.py`). A bucket that fails to
capture, does not fit the memory budget, or replays differently from eager in the consistency
check is recorded in the BucketTable with its reason and runs eager. Nothing is ever captured on
the request path. With tensor parallelism the ranks agree on the captured buckets before verifying
them (each verification replays all-reduces, which must pair up across ranks) and again after.

`full` captures the whole step; `piecewise` captures the pieces between attention calls and runs
attention eager (for backends that cannot be captured).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import NamedTuple

import torch

from policies import cached_prefill
from policies.dispatch import BucketTable, Dispatch, EngineState, ExecutionMode, FallbackReason, bucket_id
from policies.graph_policy import GraphPolicy
from workers.graphs.capture import (
    MB,
    CapturedBuckets,
    agree_on_table,
    any_rank,
    bucket_report,
    capture_ladder,
    captured_bytes,
    compare_logits,
)
from workers.graphs.compiled_step import CompiledStep, graphs_compiled, no_recompile
from workers.graphs.prefill_graphs import PrefillGraphs, prefill_bucket_id
from workers.graphs.shadow_verify import ShadowVerifier
from workers.kv.attention import GraphSupport
from workers.kv.kv_cache import KVCache, pages_needed
from workers.model_runner.runner import ModelRunner
from workers.model_runner.step_inputs import DecodeInputs, PrefillInputs
from workers.modeling.model import LlamaModel, last_tokens

log = logging.getLogger(__name__)
PROBE_PAGES = 3  # pages of context per probe slot: enough to cross two page boundaries


def initial_table(
    policy: GraphPolicy, buckets: tuple[int, ...], cuda: bool, graph_support: GraphSupport
) -> BucketTable:
    """The bucket table a runner starts from, before any capture: what the device, the policy and the
    attention backend allow, in that order of precedence."""
    mode = ExecutionMode.PIECEWISE if policy.mode == "piecewise" else ExecutionMode.CUDA_GRAPH
    table = BucketTable(buckets, mode)
    if not cuda:
        table.global_reason = FallbackReason.UNAVAILABLE
    elif policy.mode == "eager" or not policy.capture_on_startup:
        table.global_reason = FallbackReason.DISABLED
    elif graph_support == "none":
        table.global_reason = FallbackReason.BACKEND_UNSUPPORTED
    elif policy.mode == "full" and graph_support == "piecewise":
        table.mode = ExecutionMode.PIECEWISE
        table.downgrade_reason = FallbackReason.BACKEND_UNSUPPORTED
    return table


def allow_compiled_shapes(shapes: int) -> None:
    """Room for `shapes` more compiled graphs of the decode step in this process. Dynamo keeps at most
    `recompile_limit` compiled versions of one function (8 by default, shared by every runner in the
    process) and past it runs the function uncompiled without saying so. A runner compiles each
    part of the step (`compiled_step.py`) once or twice, never more than once per bucket, so it
    raises the limit by its number of buckets, and past it dynamo raises instead: a bucket either
    runs compiled or startup fails."""
    torch._dynamo.config.recompile_limit += shapes
    torch._dynamo.config.fail_on_recompile_limit_hit = True


class GraphRunner(CapturedBuckets):
    """`prefill_buckets`: the token counts whose prefills are captured (none: prefill runs eager);
    a LoRA runner's prefills always run eager."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        policy: GraphPolicy,
        lora: bool = False,
        prefill_buckets: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.lora = lora
        self.prefix = "lora_" if lora else ""
        self.cache = cache
        self.policy = policy
        self.backend = model.attention_backend
        self.device = model.embed.weight.device
        buckets = policy.buckets(cache.num_slots)  # a cache has one slot per sequence of a batch
        super().__init__(initial_table(policy, buckets, self.device.type == "cuda", self.backend.graph_support))
        if self.table.global_reason == FallbackReason.BACKEND_UNSUPPORTED:
            log.warning("attention backend %s cannot run under CUDA graphs: decoding eager", self.backend.name)
        elif self.table.downgrade_reason == FallbackReason.BACKEND_UNSUPPORTED:
            log.warning("attention backend %s cannot be captured: mode full -> piecewise", self.backend.name)
        self._pool = None  # the memory pool of the capture in progress (see `_capture_bucket`)
        self.compile_s = 0.0
        self.phase_s: dict[str, float] = {}  # start-up seconds by phase: compile (or warmup), capture, verify
        self.first_call_s: dict[int, float] = {}  # each bucket's first decode step at warm-up (compiles)
        self.graphs = 0  # graphs dynamo compiled for this runner's warm-up
        self.model_runner = ModelRunner(model, cache, max(buckets), lora)
        self.compiled = False
        self.shadow = ShadowVerifier(policy.shadow_verify_every_n_steps)
        if policy.compiles and self.table.mode == ExecutionMode.CUDA_GRAPH and self.table.global_reason is None:
            self.use_compiled_step()
        self.prefill_graphs = None if lora or not prefill_buckets else PrefillGraphs(model, cache, prefill_buckets)

    def use_compiled_step(self) -> None:
        """Capture (and run eagerly at captured buckets) the decode step compiled once for every
        bucket (`compiled_step.py`); warm-up compiles it."""
        allow_compiled_shapes(len(self.table.buckets))
        self.model_runner.step_fn = CompiledStep(self.model)
        self.compiled = True

    @property
    def enabled(self) -> bool:
        return self.table.global_reason is None

    def bucket_id(self, bucket: int | None) -> str:
        """A bucket's name in reports and metrics: decode_bs_N, lora_decode_bs_N for LoRA graphs."""
        return "none" if bucket is None else self.prefix + bucket_id(bucket)

    @staticmethod
    def prefill_bucket_id(bucket: int | None) -> str:
        """A prefill bucket's name: prefill_tokens_N."""
        return "none" if bucket is None else prefill_bucket_id(bucket)

    # -- the step ------------------------------------------------------------------------------

    def decode(self, batch: DecodeInputs, drawn: torch.Tensor | None = None) -> tuple[torch.Tensor, Dispatch]:
        """Logits (rows, vocab) for one decode step, by graph when the table allows, else eager.
        `drawn`: the tokens of the batch's first rows, on the device (the step before drew them and
        the host has not read them yet; their places in `batch.tokens` hold anything)."""
        dispatch = self.table.dispatch(batch.rows)
        if dispatch.mode == ExecutionMode.EAGER:
            return self.eager(batch, drawn), dispatch
        self.cache.set_pages(batch.pages)
        self.model_runner.load(batch, dispatch.bucket, drawn)
        logits = self._replays[dispatch.bucket]()[: batch.rows]
        if self.shadow.due():
            return self._shadow_check(dispatch.bucket, logits), dispatch
        return logits, dispatch

    def _shadow_check(self, bucket: int, replayed: torch.Tensor) -> torch.Tensor:
        """Recompute the step just replayed with the function it was captured from, on the same static
        inputs (see `shadow_verify.py`); a mismatch withdraws the bucket on every rank. Returns the
        step's logits: the eager ones, which are right whatever the graph did."""
        eager = self.model_runner.step(bucket)[: replayed.shape[0]]
        detail = self.shadow.compare(self.bucket_id(bucket), replayed, eager)
        if any_rank(detail is not None, self.model.tp, self.device):  # every rank withdraws it, or none
            detail = detail or f"{self.bucket_id(bucket)}: mismatch on another tensor-parallel rank"
            log.error("shadow verification failed, bucket %d runs eager from now on: %s", bucket, detail)
            self._withdraw(bucket, FallbackReason.VERIFY_MISMATCH, f"shadow verification: {detail}")
        return eager

    def eager(self, batch: DecodeInputs, drawn: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of a step run without graphs. Where the batch's bucket is captured, this runs the
        function it was captured from (compiled, if the policy compiles) on the same padded static
        inputs: a replay computes exactly that, so a request's tokens do not depend on whether it
        replays or is denied graphs (tenant toggle, rollout holdback). cuBLAS picks its kernels by
        the row count and the compiled step rounds unlike the plain one, and on a real model's near
        ties either alone changes tokens. Elsewhere (no graphs, a bucket that failed to capture,
        rows above the ladder) the plain step on the live rows. `drawn` as for `decode`."""
        bucket = self.table.padded_size(batch.rows) if self.enabled else None
        self.cache.set_pages(batch.pages)
        if bucket in self.table.ready:
            self.model_runner.load(batch, bucket, drawn)
            return self.model_runner.step(bucket)[: batch.rows]
        return self.model_runner.decode(batch, drawn)

    def prefill(self, batch: PrefillInputs, graphs: bool = True) -> tuple[torch.Tensor, Dispatch]:
        """Logits of each sequence's last token, and how the call ran: a few tokens as rows of a
        replayed decode step (`policies/cached_prefill.py`), else replayed prefill graphs where a
        bucket of token counts holds the batch, else eager. `graphs=False` (a request denied graphs
        is in the batch) runs the eager twin of the step or of the bucket's graphs, which computes
        what a replay would, or eager where no graphs are ready. Here so every rank makes each
        model call the same one way."""
        self.cache.set_pages(batch.pages)
        bucket = self._rows_bucket(batch)
        if bucket is not None:
            rows = DecodeInputs(batch.tokens, batch.positions, batch.slots, batch.adapters)  # edits applied
            if graphs:
                logits, dispatch = self.decode(rows)
            else:
                logits, dispatch = self.eager(rows), Dispatch(ExecutionMode.EAGER, bucket, None)
            return logits[last_tokens(batch.lens, self.device)], replace(dispatch, decode_rows=True)
        if self.prefill_graphs is None:
            reason = FallbackReason.DISABLED if self.enabled else self.table.global_reason
            return self.model_runner.prefill(batch), Dispatch(ExecutionMode.EAGER, None, reason)
        return self.prefill_graphs.prefill(batch, graphs, self.model_runner.prefill)

    def _rows_bucket(self, batch: PrefillInputs) -> int | None:
        """The decode bucket that runs the batch as rows, where the rule takes it and that bucket
        replays a full graph; else None."""
        if not (self.policy.capture_prefill and cached_prefill.prefill_as_decode_rows(batch.lens, batch.context_lens)):
            return None
        dispatch = self.table.dispatch(len(batch.tokens))
        return dispatch.bucket if dispatch.mode == ExecutionMode.CUDA_GRAPH else None

    # -- startup -------------------------------------------------------------------------------

    def _scratch_batch(self, bucket: int) -> DecodeInputs:
        """A warmup batch that writes only the scratch slot: random tokens at distinct positions."""
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.model.cfg.vocab_size, (bucket,), generator=g).tolist()
        positions = [i % self.cache.max_model_len for i in range(bucket)]
        return DecodeInputs(tokens, positions, [self.cache.scratch_slot] * bucket, [0] * bucket)

    def probe(self, bucket: int, seed: int) -> DecodeInputs:
        """A verification batch whose rows differ in what a graph could mix up: row i decodes a random
        token in a real slot (distinct slots in shuffled order while there are enough; rows beyond
        num_slots share them) at a position of 1..span-2, distinct while there are that many rows,
        so lengths differ and cross page boundaries. Each probe slot gets `span` positions' worth
        of pages drawn at random from the whole pool (scattered, as a long-running server leaves
        them), set by the batch's block-table edits. span = min(n + 2, PROBE_PAGES pages) keeps the
        probe's KV small at large buckets; rows past n (a pool or max_model_len too small for
        more), if any, pad like the model runner's padding rows. A LoRA runner's rows take turns through
        the adapter slots, 0 included. The same on every rank: it depends only on the bucket, the
        seed and the cache's shape."""
        cache = self.cache
        g = torch.Generator().manual_seed(seed)
        n = max(0, min(bucket, cache.max_model_len - 2))
        while n and min(n, cache.num_slots) * pages_needed(self._probe_span(n), cache.page_size) > cache.num_pages - 1:
            n -= 1
        span = self._probe_span(n)
        tokens = torch.randint(0, self.model.cfg.vocab_size, (n,), generator=g).tolist()
        positions = (torch.randperm(n, generator=g) % max(1, span - 2) + 1).tolist()
        order = torch.randperm(cache.num_slots, generator=g).tolist()
        slots = [order[i % len(order)] for i in range(n)]
        per_slot = pages_needed(span, cache.page_size)
        real = order[: min(n, cache.num_slots)]
        pool = (torch.randperm(cache.num_pages - 1, generator=g) + 1)[: len(real) * per_slot].tolist()
        pages = [v for j, slot in enumerate(real) for k in range(per_slot) for v in (slot, k, pool[j * per_slot + k])]
        pad = bucket - n
        turns = self.model.lora.max_loras + 1 if self.lora else 1  # LoRA rows: slots 0, 1, ... in turn
        adapters = [(i + seed) % turns for i in range(n)] + [0] * pad
        return DecodeInputs(
            tokens + [0] * pad, positions + [0] * pad, slots + [cache.scratch_slot] * pad, adapters, pages
        )

    def _probe_span(self, rows: int) -> int:
        return min(rows + 2, PROBE_PAGES * self.cache.page_size)

    @contextlib.contextmanager
    def _probe_kv(self, batch: DecodeInputs, seed: int) -> Iterator[Callable[[], None]]:
        """Point the probe slots at the probe's pages, filled with random K/V for the rows to attend
        to; the pages' contents and the slots' block-table rows are put back as they were on exit.

        Each probe slot's pages hold its rows' context, their own writes and the position past them
        (so a mask that sees one position too many or too few changes the output), and also where a
        graph that mixes rows with slots or is one position off would write, so those writes are
        undone too. Yields `reset`, which fills the pages with the same random K/V again, so eager
        and replay start from one state. The pages' old contents are held while one bucket is
        verified: at most PROBE_PAGES pages per probe slot."""
        cache = self.cache
        real = sorted({s for s in batch.slots if s != cache.scratch_slot})
        if not real:
            yield lambda: None
            return
        rows = torch.tensor(real, device=self.device)
        pages = torch.tensor(batch.pages[2::3], device=self.device)
        saved_rows = cache.block_table[rows].clone()
        layers = (cache.k, cache.v)
        saved = [c[:, pages] for c in layers]  # advanced indexing: copies
        cache.set_pages(batch.pages)

        def reset() -> None:
            g = torch.Generator(self.device).manual_seed(seed)
            for c, s in zip(layers, saved):
                c[:, pages] = torch.randn(s.shape, generator=g, dtype=s.dtype, device=self.device)

        try:
            yield reset
        finally:
            for c, s in zip(layers, saved):
                c[:, pages] = s
            cache.block_table[rows] = saved_rows

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run every bucket's step twice (on a side stream on CUDA) so lazy initialisation,
        autotuning and compilation happen before capture. The first round, largest bucket first,
        compiles (graphs every size shares, see `compiled_step.py`); in the second nothing may
        compile, so a bucket left without a compiled graph fails start-up here."""
        stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        if stream:
            # The cache's pool and block table were just filled on the current stream; the side
            # stream must not read them before (a block table not yet zeroed sends writes anywhere).
            stream.wait_stream(torch.cuda.current_stream())
        buckets = sorted(self.table.buckets if self.enabled else (1,), reverse=True)
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            t0, graphs = time.perf_counter(), graphs_compiled()
            self.first_call_s = {}
            for bucket in buckets:
                started = time.perf_counter()
                self.model_runner.load(self._scratch_batch(bucket), bucket)
                self.model_runner.step(bucket)
                if stream:
                    torch.cuda.synchronize()
                self.first_call_s[bucket] = time.perf_counter() - started
            with no_recompile():
                for bucket in buckets:
                    self.model_runner.load(self._scratch_batch(bucket), bucket)
                    self.model_runner.step(bucket)
            if stream:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            if self.prefill_graphs is not None:  # eager pieces per prefill bucket: lazy init, no compile
                self.prefill_graphs.warmup()
                if stream:
                    torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0 - seconds
        self.phase_s["warmup"] = prefill_s + (0.0 if self.compiled else seconds)
        if self.compiled:
            self.phase_s["compile"] = self.compile_s = seconds
            self.graphs = graphs_compiled() - graphs
            slowest = sorted(self.first_call_s.items(), key=lambda kv: -kv[1])[:3]
            log.info(
                "compiled the decode step for %d buckets: %d graphs, %.1f s (slowest first calls: %s)",
                len(buckets),
                self.graphs,
                seconds,
                ", ".join(f"bs {b} {s:.1f} s" for b, s in slowest),
            )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every decode bucket, largest first, into one pool, within the policy's limits;
        then the prefill buckets, within what the decode graphs left of the memory budget."""
        if not self.enabled:
            return
        budget = self.policy.graph_memory_budget_mb * MB
        try:
            used = capture_ladder(
                self.table,
                self.records,
                self._capture_bucket,
                self._withdraw,
                budget,
                self.policy.max_cached_graphs,
            )
        finally:
            self._pool = None
        log.info("captured %d/%d decode buckets, %.1f MB", len(self.table.ready), len(self.table.buckets), used / MB)
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture(budget - used)

    def _capture_bucket(self, bucket: int) -> int:
        """Capture one bucket into the capture's shared pool (made by the first bucket) and return
        the device memory it took, in bytes. Everything capture needs of the CUDA runtime beyond
        `empty_cache` (a no-op without CUDA) is here, so a CPU test can stand in for graphs by
        replacing this one method."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self.table.mode == ExecutionMode.CUDA_GRAPH:
            return captured_bytes(lambda: self._capture_full(bucket, self._pool))
        return captured_bytes(lambda: self._capture_piecewise(bucket, self._pool))

    def _capture_full(self, bucket: int, pool) -> None:
        graph = torch.cuda.CUDAGraph()
        self._graphs[bucket] = [graph]
        with torch.cuda.graph(graph, pool=pool):
            out = self.model_runner.step(bucket)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        self._replays[bucket] = replay

    def _capture_piecewise(self, bucket: int, pool) -> None:
        """One graph per stretch between attention calls: embed + layer 0 up to attention; then
        each layer's rest + the next layer up to attention; then the last layer's rest + logits.
        Attention runs eager between them, reading the queries the previous graph left."""
        m, cache = self.model, self.cache
        tokens, positions, slots, adapters = self.model_runner.views(bucket)
        attn_out = torch.zeros(
            bucket, m.layers[0].attn.num_heads * m.cfg.head_dim, dtype=m.cfg.dtype, device=self.device
        )
        graphs = self._graphs[bucket] = []

        def capture(fn):
            graphs.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(graphs[-1], pool=pool):
                return fn()

        def first():
            h, cos, sin = m.embed_tokens(tokens, positions)
            index = cache.write_index(slots, positions)
            lora = m._lora_batch(adapters)
            return h, cos, sin, index, lora, m.pre_attention(0, h, cos, sin, index, cache, lora)[0]

        h, cos, sin, index, lora, q = capture(first)
        queries = [q]
        for i in range(1, len(m.layers)):

            def middle(i=i, h=h):
                h = m.post_attention(i - 1, h, attn_out, lora)
                return h, m.pre_attention(i, h, cos, sin, index, cache, lora)[0]

            h, q = capture(middle)
            queries.append(q)
        last_h = h
        logits = capture(lambda: m.logits(m.post_attention(len(m.layers) - 1, last_h, attn_out, lora)))

        def replay() -> torch.Tensor:
            window = m.cfg.sliding_window
            meta = self.backend.prepare(cache, positions, window)
            graphs[0].replay()
            for i, q in enumerate(queries):
                attn_out.copy_(self.backend(q, *cache.layer(i), cache, slots, meta, window))
                graphs[i + 1].replay()
            return logits

        self._replays[bucket] = replay

    @torch.inference_mode()
    def verify(self) -> None:
        """Before READY: each captured bucket must replay what the same step computes eagerly on a
        probe batch, or it is withdrawn (`verify_mismatch`). LoRA graphs are checked with random
        adapters in every slot (emptied after), the probe's rows taking turns between them."""
        slots = self.model.lora if self.lora else None
        with slots.random_contents(seed=7) if slots else contextlib.nullcontext():
            failed = self._failed_decode_buckets()
        for bucket, detail in failed.items():
            self._withdraw(bucket, FallbackReason.VERIFY_MISMATCH, detail)
            log.warning("bucket %d failed verification: %s", bucket, detail)
        if self.prefill_graphs is not None:
            self.prefill_graphs.verify()

    def check_buckets(self) -> dict[str, str]:
        """Each captured bucket's replay against the same call run eagerly on a probe batch (decode
        buckets attend to random K/V from `_probe_kv`, both runs from the same cache state): the
        buckets that disagree, by bucket id, with why. Withdraws nothing, so a model gate can check
        and still put the old weights back. Every real slot's KV is left as it was (only the
        scratch slot may change), so this may run again, also with live sequences in the cache."""
        failed = {self.bucket_id(b): detail for b, detail in self._failed_decode_buckets().items()}
        if self.prefill_graphs is not None:
            failed |= {self.prefill_graphs.bucket_id(b): d for b, d in self.prefill_graphs.failed_buckets().items()}
        return failed

    def _failed_decode_buckets(self) -> dict[int, str]:
        failed = {}
        for bucket in sorted(self.table.ready):
            detail = self._check(bucket, self.probe(bucket, bucket + 1), bucket + 1)
            if detail is not None:
                failed[bucket] = detail
        return failed

    def _check(self, bucket: int, batch: DecodeInputs, seed: int) -> str | None:
        """Why bucket's replay of `batch` differs from eager, or None. Non-finite logits always fail:
        NaN compares False with any tolerance."""
        with self._probe_kv(batch, seed) as reset:
            reset()
            self.model_runner.load(batch, bucket)
            eager = self.model_runner.step(bucket).float()
            reset()
            replayed = self._replays[bucket]().float()
        return compare_logits(self.records[bucket], replayed, eager)

    @torch.inference_mode()
    def check_adapter(self, slot: int, others: list[int], problem: str | None = None) -> str | None:
        """Before an adapter just copied into `slot` serves: a probe batch whose rows take turns
        between it, no adapter and the other loaded ones must replay what eager computes, on the
        smallest captured bucket with room for that mix. Without graphs, the eager probe's logits
        must be finite. With tensor parallelism every rank runs it and all fail it together, also
        for a `problem` one rank had before (its shard could not be read)."""
        mix = [slot, 0, *others]
        ready = sorted(self.table.ready)
        bucket = next((b for b in ready if b >= len(mix)), ready[-1] if ready else None)
        rows = bucket or min(len(mix), max(self.table.buckets))
        seed = 1_000_003 + slot
        batch = self.probe(rows, seed)
        real = sum(s != self.cache.scratch_slot for s in batch.slots)
        batch = batch._replace(adapters=[mix[i % len(mix)] if i < real else 0 for i in range(rows)])
        if bucket is not None:
            detail = self._check(bucket, batch, seed)
        else:
            with self._probe_kv(batch, seed) as reset:
                reset()
                finite = bool(torch.isfinite(self.eager(batch)).all())
            detail = None if finite else "non-finite logits in an eager probe step"
        detail = problem or detail
        if any_rank(detail is not None, self.model.tp, self.device):
            return detail or "failed on another tensor-parallel rank"
        return None

    def agree(self) -> None:
        """With tensor parallelism: a bucket (decode or prefill) replays only if it is ready on
        every rank (`capture.agree_on_table`)."""
        tp = self.model.tp
        if tp.world_size == 1 or not self.enabled:
            return
        agree_on_table(self.table, tp, self.device, self._withdraw)
        if self.prefill_graphs is not None:
            self.prefill_graphs.agree()

    def prepare(self, on_state: Callable[[EngineState], None] = lambda state: None) -> None:
        """Warm up, capture, (with TP) agree, verify and agree again, in the same order on every rank:
        agreeing first makes every rank verify the same buckets, so verification's all-reduces pair
        up; agreeing after withdraws everywhere a bucket that failed verification on one rank.
        Nothing compiles after warm-up: capture and verification run what it compiled. Each phase's
        seconds are kept in `phase_s`."""
        self.warmup()
        on_state(EngineState.EAGER_WARMED)
        if self.enabled:
            with self._timed("capture"), no_recompile():
                self.capture()
            on_state(EngineState.GRAPH_CAPTURED)
            with self._timed("verify"), no_recompile():
                self.agree()
                self.verify()
                self.agree()

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + time.perf_counter() - t0

    def graph_memory_mb(self) -> float:
        prefill = self.prefill_graphs.captured_mb() if self.prefill_graphs is not None else 0.0
        return self.captured_mb() + prefill

    def report(self) -> dict:
        """Per decode bucket, its capture facts for status pages."""
        return bucket_report(self.table, self.records, self.bucket_id, self.compiled)


class StepRunners(NamedTuple):
    """A rank's runners: the plain one, and with LoRA enabled one captured with the adapters. A
    call goes to the LoRA runner only when one of its rows names an adapter, decided from the
    inputs alone, so every tensor-parallel rank picks the same runner."""

    base: GraphRunner
    lora: GraphRunner | None = None

    def of(self, batch: DecodeInputs | PrefillInputs) -> GraphRunner:
        return self.lora if self.lora is not None and batch.uses_lora else self.base

    @property
    def all(self) -> tuple[GraphRunner, ...]:
        return (self.base,) if self.lora is None else (self.base, self.lora)

    def prepare(self, on_state: Callable[[EngineState], None] = lambda state: None) -> None:
        for runner in self.all:
            runner.prepare(on_state)
