"""Per-call time of the paged decode kernel (`workers/kv/paged_attention.py`) against the plain-torch
reference that gathers each row's whole block-table row, on the 8B and 1B attention shapes.

Each timing replays a CUDA graph of many calls (per-call time = graph time / calls, so launch cost
drops out) and takes the median over replays, with L2 flushed before each replay. Call i of a graph
reads its own pages, consecutive slices of one random permutation of a 300k-token pool, so no call
finds the previous call's keys in L2, as in a real decode step where the other layers run between.
The sweep times a grid of num_splits x (BLOCK_N, num_warps, num_stages) at a few batch shapes; it is
what `default_config` was chosen from.

    PYTHONPATH=. python3 bench/paged_attention_kernel.py --out bench/results/paged_attention_kernel_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from workers.kv.paged_attention import SplitConfig, default_config, paged_decode_reference, run_kernel

SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64)}  # query heads, kv heads, head_dim
PAGE_SIZE, MAX_PAGES, POOL_TOKENS = 16, 512, 300_000  # max_model_len 8192
CONTEXTS, BATCHES = (256, 4096), (1, 8, 32, 64, 128, 256)
CALLS = 32
SWEEP_POINTS = ((1, 4096), (8, 4096), (32, 4096), (64, 4096), (1, 256), (32, 256), (256, 256))
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_CONFIGS = ((16, 4, 2), (32, 4, 2), (64, 4, 2), (32, 2, 2), (32, 4, 3), (64, 8, 3))


class Timer:
    def __init__(self) -> None:
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # several times the 60 MB L2

    def per_call_us(self, fn: Callable[[int], torch.Tensor], calls: int, replays: int) -> float:
        """Median over replays of a graph of fn(0) .. fn(calls - 1), divided by calls."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(0)  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(replays):
            self.flush.zero_()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return statistics.median(times)


class Point:
    """One batch shape: a query batch and `CALLS` block tables over disjoint live pages."""

    def __init__(self, pool: tuple[torch.Tensor, torch.Tensor], heads: int, batch: int, context: int) -> None:
        self.k_pages, self.v_pages = pool
        num_pages, _, kv_heads, dim = self.k_pages.shape
        g = torch.Generator(device="cuda").manual_seed(batch * 10_000 + context)
        self.q = torch.randn(batch, heads, dim, generator=g, device="cuda", dtype=self.k_pages.dtype)
        live_pages = context // PAGE_SIZE
        perm = torch.randperm(num_pages, generator=g, device="cuda").int()
        self.tables = []
        for i in range(CALLS):
            live = perm[(i * batch * live_pages + torch.arange(batch * live_pages, device="cuda")) % num_pages]
            dead = perm[torch.randint(num_pages, (batch, MAX_PAGES - live_pages), generator=g, device="cuda")]
            self.tables.append(torch.cat([live.view(batch, live_pages), dead], dim=1))
        self.slot_ids = torch.randperm(batch, generator=g, device="cuda")
        self.lengths = torch.full((batch,), context, device="cuda")
        self.live_bytes = 2 * batch * context * kv_heads * dim * self.k_pages.element_size()
        self.full_bytes = self.live_bytes * MAX_PAGES * PAGE_SIZE // context

    def kernel(self, config: SplitConfig) -> Callable[[int], torch.Tensor]:
        return lambda i: run_kernel(
            self.q, self.k_pages, self.v_pages, self.tables[i], self.slot_ids, self.lengths, None, config
        )

    def reference(self, i: int) -> torch.Tensor:
        return paged_decode_reference(
            self.q, self.k_pages, self.v_pages, self.tables[i], self.slot_ids, self.lengths, None
        )


def make_pool(kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (POOL_TOKENS // PAGE_SIZE, PAGE_SIZE, kv_heads, dim)
    return tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    timer, device = Timer(), torch.device("cuda")
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "page_size": PAGE_SIZE,
        "max_pages": MAX_PAGES,
        "pool_tokens": POOL_TOKENS,
        "calls_per_graph": CALLS,
    }
    results: dict = {"meta": meta, "table": [], "sweep": []}
    for name, (heads, kv_heads, dim) in SHAPES.items():
        pool = make_pool(kv_heads, dim)
        for context in CONTEXTS:
            for batch in BATCHES:
                if batch * context > POOL_TOKENS:  # one call's live keys must fit the pool
                    continue
                point = Point(pool, heads, batch, context)
                config = default_config(batch, kv_heads, dim, MAX_PAGES, PAGE_SIZE, device)
                kernel_us = timer.per_call_us(point.kernel(config), CALLS, 10)
                ref_calls = max(2, min(CALLS, (8 << 30) // point.full_bytes))
                reference_us = timer.per_call_us(point.reference, ref_calls, 5)
                row = {
                    "shape": name,
                    "batch": batch,
                    "context": context,
                    "num_splits": config.num_splits,
                    "block_n": config.block_n,
                    "kernel_us": kernel_us,
                    "live_kv_bytes": point.live_bytes,
                    "kernel_gb_s": point.live_bytes / kernel_us / 1e3,
                    "reference_us": reference_us,
                    "reference_kv_bytes": point.full_bytes,
                    "speedup": reference_us / kernel_us,
                }
                print(json.dumps(row), flush=True)
                results["table"].append(row)
                Path(args.out).write_text(json.dumps(results, indent=1))
        if args.no_sweep:
            continue
        for batch, context in SWEEP_POINTS:
            point, rows = Point(pool, heads, batch, context), []
            for block_n, num_warps, num_stages in SWEEP_CONFIGS:
                for splits in SWEEP_SPLITS:
                    us = timer.per_call_us(point.kernel(SplitConfig(splits, block_n, num_warps, num_stages)), CALLS, 10)
                    rows.append(
                        {
                            "shape": name,
                            "batch": batch,
                            "context": context,
                            "num_splits": splits,
                            "block_n": block_n,
                            "num_warps": num_warps,
                            "num_stages": num_stages,
                            "kernel_us": us,
                            "kernel_gb_s": point.live_bytes / us / 1e3,
                        }
                    )
            results["sweep"] += rows
            best = min(rows, key=lambda r: r["kernel_us"])
            print("best", json.dumps(best), flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
