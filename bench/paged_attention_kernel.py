"""Per-call time of the paged decode kernels (`workers/kv/paged_attention.py`) against the scheme they
replaced (per-row splits, reimplemented below as `legacy_decode`) and the plain-torch reference that
gathers each row's whole block-table row, on the 8B and 1B attention shapes, for uniform batches and
for mixed ones (`bench.decode_tpot.mixed_contexts`: log-normal and bimodal live lengths).

Each timing replays a CUDA graph of many calls (per-call time = graph time / calls, so launch cost
drops out) and takes the median over replays, with L2 flushed before each replay. Call i of a graph
reads its own pages, consecutive slices of one random permutation of the pool, so no call finds the
previous call's keys in L2, as in a real decode step where the other layers run between. The work
list's graph holds one plan and then the calls, as a decode step plans once for all its layers: its
per-call time includes 1/CALLS of a plan, and the plan alone is timed too. The sweep times the work
list at half and twice its default items_per_kv_head. `--baseline FILE` times an earlier
`workers/kv/paged_attention.py` (saved with `git show REV:workers/kv/paged_attention.py > FILE`) on
the same batches in the same graphs, so a change to the plan or the kernel is compared within one run.

    PYTHONPATH=. python -m bench.paged_attention_kernel --shapes 8b \
        --out bench/results/paged_attention_kernel_8b_h200.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import triton
import triton.language as tl

from bench.decode_tpot import mixed_contexts
from workers.kv import paged_attention
from workers.kv.paged_attention import (
    LOG2E,
    NO_WINDOW,
    WorkConfig,
    default_config,
    paged_decode_reference,
    run_plan,
)

SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64)}  # query heads, kv heads, head_dim
PAGE_SIZE, MAX_PAGES, POOL_TOKENS = 16, 512, 600_000  # max_model_len 8192; a pool for 456k live tokens a call
CONTEXTS, BATCHES = (256, 4096), (1, 8, 32, 64, 128, 256)
MIXES, MIXED_BATCHES = ("lognormal", "bimodal"), (32, 64, 128)
CALLS = 32
SWEEP_POINTS = (("uniform", 8, 4096), ("uniform", 32, 256), ("uniform", 256, 256), ("lognormal", 64), ("bimodal", 128))
SWEEP_SCALES = (0.5, 2.0)
LEGACY_PROGRAMS_PER_SM, LEGACY_MIN_CHUNK = 4, 256


@triton.jit
def _legacy_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    slot_ptr,
    len_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qr,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_tr,
    group,
    window,
    qk_scale,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The replaced scheme: grid (rows, kv_heads, num_splits), split s of a row takes the s-th of
    num_splits equal chunks of that row's live range, whatever the other rows' lengths."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    live = tl.load(len_ptr + row).to(tl.int32)
    start = tl.maximum(live - window, 0)
    chunk = tl.cdiv(tl.cdiv(live - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, live)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * group + offs_g
    real_head = offs_g < group
    q = tl.load(
        q_ptr + row * stride_qr + heads[:, None] * stride_qh + offs_d[None, :], mask=real_head[:, None], other=0.0
    )
    table_row = table_ptr + tl.load(slot_ptr + row) * stride_tr
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for block in range(lo, hi, BLOCK_N):
        tok = block + offs_n
        in_chunk = tok < hi
        page = tl.load(table_row + tok // PAGE, mask=in_chunk, other=0).to(tl.int64)
        kv = page * stride_kp + (tok % PAGE) * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + kv[None, :] + offs_d[:, None], mask=in_chunk[None, :], other=0.0)
        s = tl.dot(q, k, input_precision="tf32") * qk_scale
        s = tl.where(in_chunk[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv[:, None] + offs_d[None, :], mask=in_chunk[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="tf32")
        m = m_new
    nonempty = total > 0
    part = (row * tl.num_programs(1) * group + heads) * num_splits + split
    tl.store(part_lse_ptr + part, tl.where(nonempty, m + tl.log2(total), float("-inf")), mask=real_head)
    out_mask = (real_head & nonempty)[:, None]
    tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], acc / total[:, None], mask=out_mask)


@triton.jit
def _legacy_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, D: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row_head = tl.program_id(0)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D)
    part = row_head * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=offs_s < num_splits, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    nonempty = (lse > float("-inf"))[:, None]
    parts = tl.load(part_out_ptr + part[:, None] * D + offs_d[None, :], mask=nonempty, other=0.0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.sum(weight, 0)
    tl.store(out_ptr + row_head * D + offs_d, out.to(out_ptr.dtype.element_ty))


def legacy_splits(rows: int, kv_heads: int, head_dim: int, device: torch.device) -> int:
    """The replaced scheme's split count: from static shapes only (the same for every row)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = LEGACY_PROGRAMS_PER_SM * sms * 128 // head_dim
    return max(1, min(programs // (rows * kv_heads), MAX_PAGES * PAGE_SIZE // LEGACY_MIN_CHUNK))


def legacy_decode(q, k_pages, v_pages, block_table, slot_ids, lengths, num_splits: int) -> torch.Tensor:
    """The replaced scheme's two launches (BLOCK_N 64, 4 warps, 2 stages, no window)."""
    rows, heads, dim = q.shape
    kv_heads = k_pages.shape[2]
    group = heads // kv_heads
    part_out = torch.empty(rows, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=q.device)
    _legacy_split_kernel[(rows, kv_heads, num_splits)](
        q,
        k_pages,
        v_pages,
        block_table,
        slot_ids,
        lengths,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        block_table.stride(0),
        group,
        NO_WINDOW,
        LOG2E / math.sqrt(dim),
        D=dim,
        PAGE=PAGE_SIZE,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64,
        num_warps=4,
        num_stages=2,
    )
    out = q.new_empty(rows, heads * dim)
    splits_pad = triton.next_power_of_2(num_splits)
    _legacy_reduce_kernel[(rows * heads,)](part_out, part_lse, out, num_splits, D=dim, SPLITS_PAD=splits_pad)
    return out


class Timer:
    def __init__(self) -> None:
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # several times the 60 MB L2

    def per_call_us(self, fn: Callable[[], object], calls: int, replays: int) -> float:
        """Median over replays of a graph of fn(), divided by calls (what fn() makes of them)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
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
    """One batch: queries, live lengths, and `CALLS` block tables over disjoint live pages."""

    def __init__(self, pool: tuple[torch.Tensor, torch.Tensor], heads: int, lengths: list[int], seed: int) -> None:
        self.k_pages, self.v_pages = pool
        num_pages, _, kv_heads, dim = self.k_pages.shape
        batch = len(lengths)
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.q = torch.randn(batch, heads, dim, generator=g, device="cuda", dtype=self.k_pages.dtype)
        live_pages = [-(-n // PAGE_SIZE) for n in lengths]
        total = sum(live_pages)
        assert total <= num_pages, "one call's live pages must fit the pool"
        perm = torch.randperm(num_pages, generator=g, device="cuda").int()
        self.tables = []
        for i in range(CALLS):
            table = perm[torch.randint(num_pages, (batch, MAX_PAGES), generator=g, device="cuda")]  # dead pages
            live = perm[(i * total + torch.arange(total, device="cuda")) % num_pages]
            for row, pages in enumerate(live.split(live_pages)):
                table[row, : len(pages)] = pages
            self.tables.append(table)
        self.slot_ids = torch.randperm(batch, generator=g, device="cuda")
        self.lengths = torch.tensor(lengths, device="cuda")
        self.live_bytes = 2 * sum(lengths) * kv_heads * dim * self.k_pages.element_size()
        self.full_bytes = 2 * batch * MAX_PAGES * PAGE_SIZE * kv_heads * dim * self.k_pages.element_size()

    def args(self, i: int) -> tuple:
        return self.q, self.k_pages, self.v_pages, self.tables[i], self.slot_ids

    def work_list(self, config: WorkConfig, kernels: ModuleType = paged_attention) -> Callable[[], object]:
        """One plan, then CALLS attention calls reading it (of `kernels`: this module or a baseline's,
        with that module's config)."""

        def run() -> None:
            plan = kernels.run_plan(self.lengths, None, config)
            for i in range(CALLS):
                kernels.run_attention(*self.args(i), plan, config)

        return run

    def plans(self, config: WorkConfig) -> Callable[[], object]:
        return lambda: [run_plan(self.lengths, None, config) for _ in range(CALLS)]

    def legacy(self, num_splits: int) -> Callable[[], object]:
        return lambda: [legacy_decode(*self.args(i), self.lengths, num_splits) for i in range(CALLS)]

    def reference(self, calls: int) -> Callable[[], object]:
        return lambda: [paged_decode_reference(*self.args(i), self.lengths, None) for i in range(calls)]


def make_pool(kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (POOL_TOKENS // PAGE_SIZE, PAGE_SIZE, kv_heads, dim)
    return tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))


def points() -> list[tuple[str, int, list[int]]]:
    """(mix, batch, lengths): the uniform contexts that fit the pool, then the mixes."""
    uniform = [("uniform", b, [c] * b) for c in CONTEXTS for b in BATCHES if b * c <= POOL_TOKENS]
    return uniform + [(mix, b, mixed_contexts(mix, b)) for mix in MIXES for b in MIXED_BATCHES]


def load_baseline(path: str) -> ModuleType:
    """An earlier paged_attention.py, imported from its file as a module of its own."""
    spec = importlib.util.spec_from_file_location("baseline_paged_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def measure(timer: Timer, shape: tuple[int, int, int], pool, mix: str, lengths: list[int], baseline=None) -> dict:
    """The work list (default config) against the replaced scheme at one batch (and against a
    baseline module's work list, if given), and the reference for uniform batches."""
    heads, kv_heads, dim = shape
    device = torch.device("cuda")
    point = Point(pool, heads, lengths, seed=len(lengths) * 10_000 + sum(lengths) % 10_000)
    config = default_config(kv_heads, dim, device)
    splits = legacy_splits(len(lengths), kv_heads, dim, device)
    row = {
        "mix": mix,
        "batch": len(lengths),
        "context_mean": statistics.mean(lengths),
        "context_max": max(lengths),
        "items_per_kv_head": config.items_per_kv_head,
        "legacy_num_splits": splits,
        "work_list_us": timer.per_call_us(point.work_list(config), CALLS, 10),
        "plan_us": timer.per_call_us(point.plans(config), CALLS, 10),
        "legacy_us": timer.per_call_us(point.legacy(splits), CALLS, 10),
        "live_kv_bytes": point.live_bytes,
    }
    if baseline is not None:
        old = baseline.default_config(kv_heads, dim, device)
        row["baseline_us"] = timer.per_call_us(point.work_list(old, baseline), CALLS, 10)
        row["speedup_vs_baseline"] = row["baseline_us"] / row["work_list_us"]
    row["speedup_vs_legacy"] = row["legacy_us"] / row["work_list_us"]
    row["work_list_gb_s"] = point.live_bytes / row["work_list_us"] / 1e3
    row["legacy_gb_s"] = point.live_bytes / row["legacy_us"] / 1e3
    if mix == "uniform":
        calls = max(2, min(CALLS, (8 << 30) // point.full_bytes))
        row["reference_us"] = timer.per_call_us(point.reference(calls), calls, 5)
    return row


def sweep(timer: Timer, shape: tuple[int, int, int], pool) -> list[dict]:
    """The work list at SWEEP_SCALES times its default items_per_kv_head, at SWEEP_POINTS."""
    heads, kv_heads, dim = shape
    default = default_config(kv_heads, dim, torch.device("cuda")).items_per_kv_head
    rows = []
    for mix, batch, *context in SWEEP_POINTS:
        lengths = context * batch if mix == "uniform" else mixed_contexts(mix, batch)
        point = Point(pool, heads, lengths, seed=batch)
        for scale in (1.0, *SWEEP_SCALES):
            config = WorkConfig(max(1, round(default * scale)))
            us = timer.per_call_us(point.work_list(config), CALLS, 10)
            rows.append(
                {
                    "mix": mix,
                    "batch": batch,
                    "context_mean": statistics.mean(lengths),
                    "items_per_kv_head": config.items_per_kv_head,
                    "work_list_us": us,
                    "work_list_gb_s": point.live_bytes / us / 1e3,
                }
            )
            print("sweep", json.dumps(rows[-1]), flush=True)
    return rows


def markdown(results: dict) -> str:
    lines = []
    baseline = any("baseline_us" in r for r in results["table"])
    for name in sorted({r["shape"] for r in results["table"]}):
        lines += [
            f"## {name}",
            "",
            "| batch | mix | mean context | legacy splits | legacy (us) |"
            + (" baseline (us) |" if baseline else "")
            + " work list (us) | x legacy |"
            + (" x baseline |" if baseline else "")
            + " work list GB/s | plan (us) | reference (us) |",
            "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if baseline else ""),
        ]
        for r in (r for r in results["table"] if r["shape"] == name):
            reference = f"{r['reference_us']:.1f}" if "reference_us" in r else "-"
            cells = [
                r["batch"],
                r["mix"],
                f"{r['context_mean']:.0f}",
                r["legacy_num_splits"],
                f"{r['legacy_us']:.1f}",
                *([f"{r['baseline_us']:.1f}"] if baseline else []),
                f"{r['work_list_us']:.1f}",
                f"{r['speedup_vs_legacy']:.2f}",
                *([f"{r['speedup_vs_baseline']:.2f}"] if baseline else []),
                f"{r['work_list_gb_s']:.0f}",
                f"{r['plan_us']:.1f}",
                reference,
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--baseline", help="an earlier workers/kv/paged_attention.py to time beside this one")
    args = ap.parse_args()
    baseline = None if args.baseline is None else load_baseline(args.baseline)
    timer = Timer()
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "page_size": PAGE_SIZE,
        "max_pages": MAX_PAGES,
        "pool_tokens": POOL_TOKENS,
        "calls_per_graph": CALLS,
    }
    results: dict = {"meta": meta, "table": [], "sweep": []}
    for name in args.shapes:
        shape = SHAPES[name]
        pool = make_pool(*shape[1:])
        for mix, _, lengths in points():
            row = {"shape": name, **measure(timer, shape, pool, mix, lengths, baseline)}
            print(json.dumps(row), flush=True)
            results["table"].append(row)
            Path(args.out).write_text(json.dumps(results, indent=1))
        if not args.no_sweep:
            results["sweep"] += [{"shape": name, **r} for r in sweep(timer, shape, pool)]
            Path(args.out).write_text(json.dumps(results, indent=1))
        del pool
        torch.cuda.empty_cache()
    print(markdown(results))


if __name__ == "__main__":
    main()
