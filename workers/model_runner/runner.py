"""One rank's model calls for one kind of step (the plain model, or with its LoRA slots): the static
decode inputs that captured graphs read, the copy of a batch into them, the decode step on them and
its plain twin on the live rows, and the prefill (`prefill_pieces.py` holds the prefill's static
buffers). Graphs are captured and replayed around these calls by `graphs/`, which also decides
whether `step_fn` is the compiled step.

Padding rows point at the KV cache's scratch slot (its block-table row is all scratch page, its
length 1) and at the null adapter, so they never touch a real sequence's keys and values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.kv.kv_cache import KVCache
from workers.model_runner.pinned_copy import PinnedCopy
from workers.model_runner.step_inputs import DecodeInputs, PrefillInputs
from workers.modeling.model import LlamaModel

DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KVCache, torch.Tensor | None], torch.Tensor]


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, max_rows: int, lora: bool = False) -> None:
        self.model = model
        self.cache = cache
        self.lora = lora
        self.device = model.embed.weight.device
        self.step_fn: DecodeStep = model.decode  # what `step` runs: the compiled step where graphs compile it
        self.inputs = torch.zeros(4, max_rows, dtype=torch.int64, device=self.device)
        self._copy = PinnedCopy(self.inputs)

    def load(self, batch: DecodeInputs, bucket: int, drawn: torch.Tensor | None = None) -> None:
        """Copy the batch into the static inputs; rows past the batch pad to the scratch slot.
        `drawn`: the tokens of the batch's first rows, on the device (drawn by the step before,
        which the host has not read yet)."""
        self._copy.fill(batch[:4], bucket, (0, 0, self.cache.scratch_slot, 0))
        if drawn is not None:
            self.inputs[0, : len(drawn)].copy_(drawn)

    def views(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """tokens, positions, slots and (LoRA runner only) adapter slots of a bucket's static inputs."""
        return (*self.inputs[:3, :bucket], self.inputs[3, :bucket] if self.lora else None)

    def step(self, bucket: int) -> torch.Tensor:
        """The decode step on a bucket's static inputs: what a graph captures, and its eager twin."""
        tokens, positions, slots, adapters = self.views(bucket)
        return self.step_fn(tokens, positions, slots, self.cache, adapters)

    def decode(self, batch: DecodeInputs, drawn: torch.Tensor | None = None) -> torch.Tensor:
        """The plain decode step on the batch's live rows, no static inputs, no padding (`drawn` as
        for `load`)."""
        tokens, positions, slots, adapters = batch.to_device(self.device)
        if drawn is not None:
            tokens[: len(drawn)].copy_(drawn)
        return self.model.decode(tokens, positions, slots, self.cache, adapters if self.lora else None)

    def prefill(self, batch: PrefillInputs) -> torch.Tensor:
        """The plain prefill of the batch's tokens: logits of each sequence's last one."""
        tokens, positions, slots, adapters = batch.to_device(self.device)
        adapters = adapters if self.lora else None
        return self.model.prefill(tokens, positions, slots, batch.lens, self.cache, adapters, batch.context_lens)
