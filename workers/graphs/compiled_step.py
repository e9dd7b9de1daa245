"""The decode step compiled once for every bucket size and every layer, then captured per bucket.

Dynamo compiles a function once per input shape unless told that a dimension varies: compiled per
bucket, the default ladder of 17 sizes cost 187 s of inductor at start-up (1B shape, H200). Here the
rows dimension of the step's per-row inputs (tokens, positions, slot ids, adapter slots, hidden
states, the attention plan) is marked dynamic on every call, so the first call (warm-up goes largest
bucket first) compiles graphs that every other size reuses. `dynamic=False` turns dynamo's automatic
dynamic shapes off, so nothing else becomes symbolic: the weights, the KV pool and the block table
stay static shapes, and a shape that changes anywhere but the rows means a new compile, never a more
generic graph.

Compiled whole, the step is a graph of every layer, and inductor's time grows with the depth (30 s of
the 1B's 16 layers, 80 s of the 8B's 32 on the H200). Compiled by region (`LlamaModel.decode`'s parts),
the step is three graphs: its start, one layer, which dynamo compiles once and every layer runs (the
layer's weights and KV pools are inputs, not constants), and its end. A layer hands on its MLP output
unadded, so the residual sum still runs inside the next layer's norm kernel, as in the whole graph.

Dynamo treats sizes 0 and 1 of a dynamic dimension as constants, which gave bucket 1 graphs of its
own. The step is traced with size-oblivious reasoning for its backed sizes (`backed_size_oblivious`,
as vLLM can): the row count keeps its hint (the first call's size, for inductor's choices) but its
range starts at 0, so size 1 runs the same graphs. A branch on the row count inside a layer (the
LoRA kernels' row limit) still adds one layer graph per side of it. So a runner compiles 3 graphs
(a LoRA runner 2 more layer graphs) whatever the ladder's length and the model's depth;
`graphs_compiled` counts them. After warm-up nothing may compile (`no_recompile`): a bucket that
would have needed another graph fails start-up instead of running a graph compiled for another
shape or none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._dynamo.utils import counters
from torch.fx.experimental import _config as fx_config

from workers.kv.kv_cache import KVCache
from workers.modeling.model import LlamaModel

ROWS = 0  # the dimension of a per-row input that varies with the bucket


class CompiledStep:
    """The model's decode step (`LlamaModel.decode`) with each of its three parts compiled by
    inductor with a dynamic row count: the start (embedding, rope rows, write positions, attention
    plan), one layer, which every layer runs, and the end (last residual, logits). Inductor's own
    CUDA graphs stay off: the graph runner captures the compiled step itself, one graph per bucket."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        options = {"triton.cudagraphs": False}
        self._start = torch.compile(model.decode_start, dynamic=False, options=options)
        self._layer = torch.compile(model.decode_layer, dynamic=False, options=options)
        self._end = torch.compile(model.decode_end, dynamic=False, options=options)

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        cache: KVCache,
        adapters: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with fx_config.patch(backed_size_oblivious=True):
            return self.model.decode(tokens, positions, slot_ids, cache, adapters, parts=self)

    def decode_start(self, tokens, positions, slot_ids, cache: KVCache) -> tuple:
        return self._start(*rows_dynamic(tokens, positions, slot_ids), cache)

    def decode_layer(self, block, h, delta, cos, sin, index, k_pages, v_pages, cache, slot_ids, plan, adapters):
        delta = packed(delta)
        h, delta, cos, sin, index, slot_ids, adapters = rows_dynamic(h, delta, cos, sin, index, slot_ids, adapters)
        plan = tuple(rows_dynamic(*plan)) if isinstance(plan, tuple) else rows_dynamic(plan)[0]
        return self._layer(block, h, delta, cos, sin, index, k_pages, v_pages, cache, slot_ids, plan, adapters)

    def decode_end(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self._end(*rows_dynamic(h, packed(delta)))


def packed(delta: torch.Tensor) -> torch.Tensor:
    """A LoRA layer's MLP output is a view into a wider GEMM output (its slots' columns beside it):
    copied to rows of its own width, so that the first layer (a zero delta) and the others share a
    graph (dynamo checks strides, of rows of one too)."""
    if delta.stride(0) == delta.shape[1]:
        return delta
    return delta.clone(memory_format=torch.contiguous_format)


def rows_dynamic(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors, each with its first dimension (rows, or the plan's items) marked dynamic."""
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_dynamic(t, ROWS)
    return list(tensors)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (warm starts included: a graph found in the
    inductor cache is still traced and counted); the difference across a warm-up is its compiles."""
    return counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def no_recompile() -> Iterator[None]:
    """Within: a call of a compiled function that finds no graph for its inputs raises instead of
    compiling one (before capture, nothing compiles on its own later)."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield
