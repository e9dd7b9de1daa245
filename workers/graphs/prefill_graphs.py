"""Prefill graphs: a prefill's pieces between attention calls (`model_runner/prefill_pieces.py`)
captured once per bucket of token counts, replayed with attention run eager between them.

A prefill of n tokens runs on the smallest bucket >= n (its tokens padded to it); above the largest
bucket, or where a bucket could not be captured, it runs eager with the reason recorded, as decode
steps do. A batch holding a request denied graphs (tenant toggle, rollout holdback) runs the eager
twin of the bucket's pieces on the same padded inputs, so what it computes does not depend on the
denial. Each bucket is verified against its eager twin before READY and withdrawn if they differ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from policies.dispatch import BucketTable, Dispatch, ExecutionMode, FallbackReason
from workers.graphs.capture import (
    MB,
    BucketRecord,
    CapturedBuckets,
    agree_on_table,
    bucket_report,
    capture_ladder,
    captured_bytes,
    compare_logits,
)
from workers.kv.kv_cache import KVCache
from workers.model_runner.prefill_pieces import PrefillPieces
from workers.model_runner.step_inputs import PrefillInputs
from workers.modeling.model import LlamaModel

log = logging.getLogger(__name__)
PROBE_PROMPTS = 3  # a verification prefill packs this many prompts, so a graph that mixes them up fails


def prefill_bucket_id(bucket: int) -> str:
    return f"prefill_tokens_{bucket}"


class PrefillGraphs(CapturedBuckets):
    def __init__(self, model: LlamaModel, cache: KVCache, buckets: tuple[int, ...]) -> None:
        super().__init__(BucketTable(buckets, ExecutionMode.PIECEWISE))
        self.model = model
        self.cache = cache
        self.device = model.embed.weight.device
        if self.device.type != "cuda":
            self.table.global_reason = FallbackReason.UNAVAILABLE
        self.pieces = PrefillPieces(model, cache, max(buckets)) if self.enabled else None
        self._pool = None  # the memory pool of the capture in progress

    bucket_id = staticmethod(prefill_bucket_id)

    @property
    def enabled(self) -> bool:
        return self.table.global_reason is None

    def prefill(
        self, batch: PrefillInputs, graphs: bool, plain: Callable[[PrefillInputs], torch.Tensor]
    ) -> tuple[torch.Tensor, Dispatch]:
        """The batch's logits by replay where its bucket is ready (its eager twin without `graphs`),
        else by `plain`, the unpadded eager prefill."""
        dispatch = self.table.dispatch(len(batch.tokens))
        if dispatch.mode == ExecutionMode.EAGER:
            return plain(batch), dispatch
        if not graphs:
            return self.pieces.run(batch, dispatch.bucket), Dispatch(ExecutionMode.EAGER, dispatch.bucket, None)
        return self.pieces.run(batch, dispatch.bucket, self._replays[dispatch.bucket]), dispatch

    def scratch_batch(self, bucket: int, seed: int | None = None) -> PrefillInputs:
        """A prefill into the scratch slot of about `bucket` tokens (fewer, so padding is exercised,
        unless the bucket is tiny) in up to PROBE_PROMPTS prompts of at most max_model_len each;
        random tokens with a seed, else zeros."""
        n = max(1, bucket - bucket // 8)
        parts = min(PROBE_PROMPTS, n)
        lens = [n // parts + (i < n % parts) for i in range(parts)]
        limit = self.cache.max_model_len
        lens = [min(limit, m - start) for m in lens for start in range(0, m, limit)]
        batch = PrefillInputs.scratch(lens, self.cache.scratch_slot)
        if seed is None:
            return batch
        g = torch.Generator().manual_seed(seed)
        return batch._replace(tokens=torch.randint(0, self.model.cfg.vocab_size, (n,), generator=g).tolist())

    def warmup(self) -> None:
        """Each bucket's eager twin once, largest first, before capture (lazy initialisation of
        every kernel the pieces launch)."""
        if self.enabled:
            for bucket in sorted(self.table.buckets, reverse=True):
                self.pieces.run(self.scratch_batch(bucket), bucket)

    @torch.inference_mode()
    def capture(self, budget_bytes: float) -> None:
        """Every bucket, largest first, into one pool of their own, within `budget_bytes`."""
        if not self.enabled:
            return
        try:
            used = capture_ladder(self.table, self.records, self._capture_bucket, self._withdraw, budget_bytes)
        finally:
            self._pool = None
        log.info("captured %d/%d prefill buckets, %.1f MB", len(self.table.ready), len(self.table.buckets), used / MB)

    def _capture_bucket(self, bucket: int) -> int:
        """One graph per piece of the bucket; the bytes they took. Everything capture needs of the
        CUDA runtime is here, so a CPU test can stand in for graphs by replacing this method."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graphs = self._graphs[bucket] = []

        def capture() -> None:
            for i in range(self.pieces.num_pieces):
                graphs.append(torch.cuda.CUDAGraph())
                with torch.cuda.graph(graphs[-1], pool=self._pool):
                    self.pieces.piece(i, bucket)

        taken = captured_bytes(capture)
        self._replays[bucket] = lambda i: graphs[i].replay()
        return taken

    @torch.inference_mode()
    def verify(self) -> None:
        for bucket, detail in self.failed_buckets().items():
            self._withdraw(bucket, FallbackReason.VERIFY_MISMATCH, detail)
            log.warning("prefill bucket %d failed verification: %s", bucket, detail)

    def failed_buckets(self) -> dict[int, str]:
        """Each ready bucket's replay of a probe prefill (random tokens, several prompts, padded)
        against its eager twin: the buckets that disagree, with why. Writes only the scratch slot."""
        failed = {}
        for bucket in sorted(self.table.ready):
            batch = self.scratch_batch(bucket, seed=bucket)
            eager = self.pieces.run(batch, bucket).float()
            replayed = self.pieces.run(batch, bucket, self._replays[bucket]).float()
            detail = compare_logits(self.records.setdefault(bucket, BucketRecord(bucket)), replayed, eager)
            if detail is not None:
                failed[bucket] = detail
        return failed

    def agree(self) -> None:
        if self.enabled:
            agree_on_table(self.table, self.model.tp, self.device, self._withdraw)

    def report(self) -> dict:
        return bucket_report(self.table, self.records, self.bucket_id, compiled=False)
