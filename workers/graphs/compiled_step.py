"""The decode step compiled once for every bucket size, then captured per bucket.

Dynamo compiles a function once per input shape unless told that a dimension varies: compiled per
bucket, the default ladder of 17 sizes cost 187 s of inductor at start-up (1B shape, H200). Here the
rows dimension of the step's per-row inputs (tokens, positions, slot ids, adapter slots) is marked
dynamic on every call, so the first call (warm-up goes largest bucket first) compiles one graph that
every other size reuses. `dynamic=False` turns dynamo's automatic dynamic shapes off, so nothing else
becomes symbolic: the weights, the KV pool and the block table stay static shapes, and a shape that
changes anywhere but the rows means a new compile, never a more generic graph.

Dynamo treats sizes 0 and 1 of a dynamic dimension as constants, which gave bucket 1 a graph of its
own (11.8 s of the 1B's 38.3 s cold compile on the H200). The step is traced with size-oblivious
reasoning for its backed sizes (`backed_size_oblivious`, as vLLM can): the row count keeps its hint
(the first call's size, for inductor's choices) but its range starts at 0, so size 1 runs the same
graph. A branch on the row count inside the step (the LoRA kernels' row limit) still adds one graph
per side of it. So a runner compiles 1-2 graphs whatever the ladder's length; `graphs_compiled`
counts them. After warm-up nothing may compile (`no_recompile`): a bucket that
would have needed another graph fails start-up instead of running a graph compiled for another
shape or none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch._dynamo.utils import counters
from torch.fx.experimental import _config as fx_config

ROWS = 0  # the dimension of a per-row input that varies with the bucket


class CompiledStep:
    """`fn` (the model's decode step) compiled by inductor with a dynamic row count. Inductor's own
    CUDA graphs stay off: the graph runner captures the compiled step itself, one graph per bucket."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = torch.compile(fn, dynamic=False, options={"triton.cudagraphs": False})

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        cache: object,
        adapters: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for rows in (tokens, positions, slot_ids, adapters):
            if rows is not None:
                torch._dynamo.mark_dynamic(rows, ROWS)
        with fx_config.patch(backed_size_oblivious=True):
            return self.fn(tokens, positions, slot_ids, cache, adapters)


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
