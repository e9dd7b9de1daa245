"""Faulty decode steps, the wrong graphs verification must catch, and CPU stand-ins for capture.

Each fault wraps `model.decode` the way a wrongly captured graph would behave: NaN logits whose
argmax is unchanged, rows and slots mixed up, a stale length (positions one behind), and a mask
that lets each row see one position more or one less. The GPU tests capture real graphs through
them; `EagerGraphRunner` lets CPU tests run the real capture bookkeeping, verify and agree around
"replays" that compute a step eagerly from the same static inputs a graph would read, and
`EagerPrefillGraphs` does the same for prefill pieces.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from policies.dispatch import FallbackReason
from policies.graph_policy import GraphPolicy
from workers.graphs.graph_runner import GraphRunner
from workers.graphs.prefill_graphs import PrefillGraphs
from workers.kv.kv_cache import KVCache
from workers.model_runner.prefill_pieces import PrefillPieces
from workers.modeling.model import LlamaModel

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KVCache, torch.Tensor | None], torch.Tensor]


def nan_at_argmax(model: LlamaModel) -> Step:
    """Each row's largest logit becomes NaN: the argmax stays where it was (torch's argmax takes
    NaN as the largest), so only a NaN-safe comparison notices."""

    def step(tokens, positions, slots, cache, adapters=None):
        logits = model.decode(tokens, positions, slots, cache, adapters)
        return logits.scatter(-1, logits.argmax(-1, keepdim=True), float("nan"))

    return step


def slots_rolled(model: LlamaModel) -> Step:
    """Row i reads and writes row i - 1's slot."""

    def step(tokens, positions, slots, cache, adapters=None):
        return model.decode(tokens, positions, slots.roll(1), cache, adapters)

    return step


def stale_length(model: LlamaModel) -> Step:
    """Every row decodes one position behind its real one (clamped at 0)."""

    def step(tokens, positions, slots, cache, adapters=None):
        return model.decode(tokens, positions.clamp(min=1) - 1, slots, cache, adapters)

    return step


class _ShiftedMask:
    """The model's attention backend with each row's visible range ending `shift` positions later."""

    def __init__(self, inner, shift: int) -> None:
        self.inner, self.shift = inner, shift
        self.name, self.graph_support = inner.name, inner.graph_support

    def prepare(self, cache: KVCache, positions: torch.Tensor, window: int | None):
        return self.inner.prepare(cache, positions + self.shift, window)

    def __call__(self, q, k_pages, v_pages, cache: KVCache, slot_ids, meta, window: int | None) -> torch.Tensor:
        return self.inner(q, k_pages, v_pages, cache, slot_ids, meta, window)


def _wrong_mask(model: LlamaModel, shift: int) -> Step:
    def step(tokens, positions, slots, cache, adapters=None):
        backend = model.attention_backend
        model.attention_backend = _ShiftedMask(backend, shift)
        try:
            return model.decode(tokens, positions, slots, cache, adapters)
        finally:
            model.attention_backend = backend

    return step


def mask_one_more(model: LlamaModel) -> Step:
    """Each row also sees the position after its own."""
    return _wrong_mask(model, 1)


def mask_one_less(model: LlamaModel) -> Step:
    """Each row misses its own position (the K/V it just wrote)."""
    return _wrong_mask(model, -1)


FAULTS: dict[str, Callable[[LlamaModel], Step]] = {
    "nan_at_argmax": nan_at_argmax,
    "slots_rolled": slots_rolled,
    "stale_length": stale_length,
    "mask_one_more": mask_one_more,
    "mask_one_less": mask_one_less,
}


class EagerGraphRunner(GraphRunner):
    """A GraphRunner on CPU whose capture of a bucket (`_capture_bucket`, the one method replaced)
    stores an eager-backed replay instead of a CUDA graph: it runs the runner's step, or the faulty
    step given for that bucket, on the static inputs. Buckets in `fail` raise at capture. Warmup,
    the capture loop's limits, verify, agree and dispatch are the real code; `replayed` counts
    replays per bucket."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        policy: GraphPolicy,
        faults: dict[int, Step] | None = None,
        fail: frozenset[int] = frozenset(),
        lora: bool = False,
        prefill_buckets: tuple[int, ...] = (),
    ) -> None:
        super().__init__(model, cache, policy, lora, prefill_buckets)
        assert self.table.global_reason == FallbackReason.UNAVAILABLE, "a CPU stand-in, for a CPU model"
        self.table.global_reason = None  # what a CUDA device would allow: the stand-in captures instead
        if self.prefill_graphs is not None:
            self.prefill_graphs = EagerPrefillGraphs(model, cache, self.prefill_graphs.table.buckets)
        self.faults = faults or {}
        self.fail = fail
        self.replayed: Counter[int] = Counter()

    def _capture_bucket(self, bucket: int) -> int:
        if bucket in self.fail:
            raise RuntimeError(f"injected capture failure of bucket {bucket}")
        step = self.faults.get(bucket, self.model_runner.step_fn)
        tokens, positions, slots, adapters = self.model_runner.views(bucket)

        def replay() -> torch.Tensor:
            self.replayed[bucket] += 1
            return step(tokens, positions, slots, self.cache, adapters)

        self._replays[bucket] = replay
        return 0


PieceFault = Callable[[PrefillPieces, int, int], None]  # (pieces, piece index, bucket): a wrong piece


def piece_reads_the_next_token(pieces: PrefillPieces, i: int, bucket: int) -> None:
    """Piece i computed on the tokens shifted by one (each token's row reads its neighbour's id)."""
    if i == 0:
        pieces.inputs[0, :bucket] = pieces.inputs[0, :bucket].roll(-1)
    pieces.piece(i, bucket)


class EagerPrefillGraphs(PrefillGraphs):
    """PrefillGraphs on CPU whose capture of a bucket stores replays that run each piece eagerly on
    the static buffers (or, for a bucket in `faults`, a faulty piece); `replayed` counts replays of
    each bucket's first piece. Dispatch, warm-up, the capture loop, verify and agree are the real
    code."""

    def __init__(
        self, model: LlamaModel, cache: KVCache, buckets: tuple[int, ...], faults: dict[int, PieceFault] | None = None
    ) -> None:
        super().__init__(model, cache, buckets)
        assert self.table.global_reason == FallbackReason.UNAVAILABLE, "a CPU stand-in, for a CPU model"
        self.table.global_reason = None
        self.pieces = PrefillPieces(model, cache, max(buckets))
        self.faults = faults or {}
        self.replayed: Counter[int] = Counter()

    def _capture_bucket(self, bucket: int) -> int:
        fault = self.faults.get(bucket)

        def replay(i: int) -> None:
            self.replayed[bucket] += i == 0
            if fault is None:
                self.pieces.piece(i, bucket)
            else:
                fault(self.pieces, i, bucket)

        self._replays[bucket] = replay
        return 0
