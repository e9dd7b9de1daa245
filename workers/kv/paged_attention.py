"""Paged decode attention in Triton over a work list balanced by live KV: one query token per row,
keys and values read from the paged KV cache through the block table, and only as far as each row's
live length.

Why a work list: a decode batch mixes short and long rows. Cutting every row into the same number of
splits (the kernel this replaced: the count could only follow static shapes) left each long row to a
few programs, which set the step time while the short rows' SMs idled: a 64-row batch of log-normal
lengths (32 to 6,000 tokens) decoded at 2.1x its floor on the 8B. Here the batch's total live tokens
are cut into chunks of one size, so every work item reads about the same bytes whatever its row:
- `_plan_kernel` (one program, once per decode step; every layer reuses its plan) sums the rows' live
  spans (the last W keys with a sliding window), sets the chunk size C = total / items_per_kv_head
  rounded up to a multiple of BLOCK_N, and gives each row span / C chunks, rounded up but for a
  row at most 1/SLACK longer than a multiple of C (at least one), its BLOCK_N-token blocks dealt
  out evenly among them. Items are listed longest first (rows sorted by tokens per chunk): programs
  start in grid order, so the big items start first and the small ones fill in at the end.
  Rounded to the nearest count, as this plan first did, a row of up to 1.5 C was one item, and on
  a log-normal mix those items set the call (`paged_attention_plan_h100.md`); rounded up outright,
  a uniform batch whose rows are a block over C (64 rows of 4096 on the 8B: C = 4032) would be cut
  in two.
- `_attention_kernel`, grid (kv_heads, max items): one program per (KV head, item) runs an online
  softmax over the item's keys, serving the KV head's whole query group as one tile so K/V are read
  once. A row of one item writes its output directly; the others write partials indexed by item.
- `_merge_kernel`, grid (rows, query heads): a row's partials, however many, merged by their
  log-sum-exp; a row of one item exits at once.

Why it can be captured in a CUDA graph: every grid and allocation follows static shapes only (rows,
heads, the config). The item count is bounded without reading a length: a row's count is below
span / C + 1 and C >= total / items_per_kv_head, so a batch never has items_per_kv_head + rows items
or more; the unused slots are marked and their programs exit at once. The chunk size, the counts and
the order are computed on the device, so one graph stays right as lengths, block table and queries
change in place.

Why these numbers (bench/paged_attention_kernel.py, bench/results/paged_attention_kernel_h200.md):
- items_per_kv_head: PROGRAMS_PER_SM programs per SM at head_dim 128 over all KV heads, twice as many
  at head_dim 64 (half the bytes a token). ptxas gives a program 94 registers and 39 KB of shared
  memory at head_dim 128 (sm_90, Triton 3.6), so an SM holds five: four per SM fit in one wave. On a
  uniform batch every row gets items_per_kv_head / rows chunks (rounded), which reproduces the split
  counts that were the fastest in the sweep of per-row splits (8B at 4096 tokens: 1, 8, 32, 64 rows
  -> 64, 8, 2, 1 chunks; 1B: 8, 32, 64 rows -> 16, 4, 2).
- BLOCK_N 64, 4 warps, 2 stages: of six (BLOCK_N, warps, stages) swept, the fastest or within 4% at 12
  of 14 batch shapes. C is never below BLOCK_N, so one row of 256 tokens is 4 items of 64 (the sweep's
  best split count there; a split past a row's end, which the per-row scheme launched anyway, costs
  no program here).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, `available()` says False
    triton = None

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # a window longer than any sequence: the kernels take an int, not None
PROGRAMS_PER_SM = 4  # work items per SM at head_dim 128 (over all KV heads); twice as many at 64
MERGE_BLOCK = 32  # partials the merge reads at a time
SLACK = 8  # a row is cut once it is more than 1/SLACK longer than the chunk size
ROW_BITS = 16  # the plan sorts (chunk size << ROW_BITS | row) keys: rows must fit these bits

Plan = tuple[torch.Tensor, torch.Tensor]  # items (max_items, 3): row, lo, hi; row_chunks (rows, 2): first, count


def available() -> bool:
    """Whether the kernel can run here: triton imports and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


@dataclass(frozen=True)
class WorkConfig:
    items_per_kv_head: int  # the batch's live tokens are cut into about this many chunks per KV head
    block_n: int = 64  # tokens per inner step: at least 16 (tl.dot), a power of two
    num_warps: int = 4
    num_stages: int = 2


@functools.cache
def _sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(kv_heads: int, head_dim: int, device: torch.device) -> WorkConfig:
    """The work split for a model shape: from static shapes and the SM count only, never from the
    lengths (no host sync, so a captured graph keeps it)."""
    programs = PROGRAMS_PER_SM * _sm_count(device.index) * 128 // head_dim
    return WorkConfig(items_per_kv_head=max(1, programs // kv_heads))


def max_items(rows: int, config: WorkConfig) -> int:
    """More work items than any lengths make: a row gets fewer than span / C + 1, and
    C >= total span / items_per_kv_head."""
    return config.items_per_kv_head + rows


if triton is not None:

    @triton.jit
    def _plan_kernel(
        len_ptr,
        items_ptr,
        chunks_ptr,
        rows,
        window,
        target,
        max_items,
        BLOCK_N: tl.constexpr,
        ROWS_PAD: tl.constexpr,
        ROW_BITS: tl.constexpr,
        SLACK: tl.constexpr,
    ):
        """One program: the chunk size from the batch's total live span, each row's chunk count and
        first item (rows sorted by chunk size, longest first), every item's (row, lo, hi), and -1 as
        the row of each unused item slot."""
        r = tl.arange(0, ROWS_PAD)
        live = tl.load(len_ptr + r, mask=r < rows, other=0).to(tl.int32)
        span = tl.minimum(live, window)
        chunk = tl.cdiv(tl.cdiv(tl.sum(span, 0), target), BLOCK_N) * BLOCK_N
        count = tl.maximum(tl.cdiv(SLACK * span - chunk, SLACK * chunk), 1)  # ceil(span / chunk - 1 / SLACK)
        key = tl.where(r < rows, (tl.cdiv(span, count).to(tl.int64) << ROW_BITS) | r, -1)
        key = tl.sort(key, descending=True)
        valid = key >= 0
        row = tl.where(valid, key & ((1 << ROW_BITS) - 1), 0).to(tl.int32)
        live = tl.load(len_ptr + row, mask=valid, other=0).to(tl.int32)
        span = tl.minimum(live, window)
        count = tl.where(valid, tl.maximum(tl.cdiv(SLACK * span - chunk, SLACK * chunk), 1), 0)
        first = tl.cumsum(count, 0) - count
        tl.store(chunks_ptr + row * 2, first, mask=valid)
        tl.store(chunks_ptr + row * 2 + 1, count, mask=valid)
        # A row's BLOCK_N-token blocks are dealt out evenly: its chunks differ by one block at most.
        blocks = tl.cdiv(span, BLOCK_N)
        start = live - span
        divisor = tl.maximum(count, 1)
        for c in range(0, tl.max(count, 0)):
            on = c < count
            item = items_ptr + (first + c) * 3
            tl.store(item, row, mask=on)
            tl.store(item + 1, start + c * blocks // divisor * BLOCK_N, mask=on)
            tl.store(item + 2, tl.minimum(start + (c + 1) * blocks // divisor * BLOCK_N, live), mask=on)
        used = tl.sum(count, 0)
        for base in range(0, max_items, ROWS_PAD):
            slot = base + r
            tl.store(items_ptr + slot * 3, -1, mask=(slot >= used) & (slot < max_items))

    @triton.jit
    def _attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        slot_ptr,
        items_ptr,
        chunks_ptr,
        out_ptr,
        part_out_ptr,
        part_lse_ptr,
        stride_qr,
        stride_qh,
        stride_kp,
        stride_kt,
        stride_kh,
        stride_tr,
        group,
        qk_scale,
        D: tl.constexpr,
        PAGE: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One (KV head, work item): online softmax over the item's keys [lo, hi) of its row, in log2
        units. A row of one item gets its output here; otherwise the normalised partial output and
        its log-sum-exp per query head go to the item's partial slot."""
        kv_head = tl.program_id(0)
        item = tl.program_id(1)
        row = tl.load(items_ptr + item * 3)
        if row < 0:  # an unused slot: the batch has fewer items than the static bound
            return
        lo = tl.load(items_ptr + item * 3 + 1)
        hi = tl.load(items_ptr + item * 3 + 2)
        single = tl.load(chunks_ptr + row * 2 + 1) == 1

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kv_head * group + offs_g
        real_head = offs_g < group
        q = tl.load(
            q_ptr + row * stride_qr + heads[:, None] * stride_qh + offs_d[None, :], mask=real_head[:, None], other=0.0
        )
        table_row = table_ptr + tl.load(slot_ptr + row) * stride_tr

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores
        total = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for block in range(lo, hi, BLOCK_N):
            tok = block + offs_n
            in_chunk = tok < hi
            page = tl.load(table_row + tok // PAGE, mask=in_chunk, other=0).to(tl.int64)
            kv = page * stride_kp + (tok % PAGE) * stride_kt + kv_head * stride_kh
            k = tl.load(k_ptr + kv[None, :] + offs_d[:, None], mask=in_chunk[None, :], other=0.0)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(in_chunk[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv[:, None] + offs_d[None, :], mask=in_chunk[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new

        out = acc / total[:, None]
        num_heads = tl.num_programs(0) * group
        if single:
            dst = out_ptr + (row * num_heads + heads)[:, None] * D + offs_d[None, :]
            tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=real_head[:, None])
        else:
            part = item * num_heads + heads
            tl.store(part_lse_ptr + part, m + tl.log2(total), mask=real_head)
            tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], out, mask=real_head[:, None])

    @triton.jit
    def _merge_kernel(part_out_ptr, part_lse_ptr, chunks_ptr, out_ptr, D: tl.constexpr, BLOCK: tl.constexpr):
        """One (row, query head) of a row of several items: their partials weighted by
        exp2(lse - max lse), read BLOCK at a time with a running max."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        count = tl.load(chunks_ptr + row * 2 + 1)
        if count == 1:  # the attention kernel wrote this row's output itself
            return
        first = tl.load(chunks_ptr + row * 2)
        heads = tl.num_programs(1)
        offs_c = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        m = float("-inf")
        total = 0.0
        acc = tl.zeros([D], tl.float32)
        for start in range(0, count, BLOCK):
            on = start + offs_c < count
            part = (first + start + offs_c) * heads + head
            lse = tl.load(part_lse_ptr + part, mask=on, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(lse, 0))
            scale = tl.exp2(m - m_new)
            weight = tl.exp2(lse - m_new)
            parts = tl.load(part_out_ptr + part[:, None] * D + offs_d[None, :], mask=on[:, None], other=0.0)
            acc = acc * scale + tl.sum(weight[:, None] * parts, 0)
            total = total * scale + tl.sum(weight, 0)
            m = m_new
        tl.store(out_ptr + (row * heads + head) * D + offs_d, (acc / total).to(out_ptr.dtype.element_ty))


def run_plan(lengths: torch.Tensor, window: int | None, config: WorkConfig) -> Plan:
    """The plan launch with an explicit config (`paged_decode_plan` picks `default_config`). Every
    length must be at least 1 (the engine points padding rows at a scratch slot of length 1)."""
    rows = lengths.shape[0]
    assert rows < 1 << ROW_BITS
    items = torch.empty(max_items(rows, config), 3, dtype=torch.int32, device=lengths.device)
    row_chunks = torch.empty(rows, 2, dtype=torch.int32, device=lengths.device)
    _plan_kernel[(1,)](
        lengths,
        items,
        row_chunks,
        rows,
        window or NO_WINDOW,
        config.items_per_kv_head,
        items.shape[0],
        BLOCK_N=config.block_n,
        ROWS_PAD=max(16, triton.next_power_of_2(rows)),
        ROW_BITS=ROW_BITS,
        SLACK=SLACK,
    )
    return items, row_chunks


def run_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    slot_ids: torch.Tensor,
    plan: Plan,
    config: WorkConfig,
) -> torch.Tensor:
    """The attention and merge launches over a plan, with an explicit config (`paged_decode` picks
    `default_config`; only block_n, num_warps and num_stages matter here)."""
    items, row_chunks = plan
    rows, heads, dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    assert heads % kv_heads == 0 and k_pages.stride() == v_pages.stride() and q.stride(2) == 1
    out = q.new_empty(rows, heads * dim)
    part_out = torch.empty(items.shape[0], heads, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(items.shape[0], heads, dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    _attention_kernel[(kv_heads, items.shape[0])](
        q,
        k_pages,
        v_pages,
        block_table,
        slot_ids,
        items,
        row_chunks,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        block_table.stride(0),
        group,
        LOG2E / math.sqrt(dim),
        D=dim,
        PAGE=page_size,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=config.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    _merge_kernel[(rows, heads)](part_out, part_lse, row_chunks, out, D=dim, BLOCK=MERGE_BLOCK)
    return out


@torch.library.custom_op("graphserve::paged_decode_plan", mutates_args=(), device_types="cuda")
def paged_decode_plan(
    lengths: torch.Tensor, window: int | None, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's work plan over the live lengths (rows,), for a model of kv_heads x head_dim: made
    once a decode step, read by every layer's `paged_decode`. A custom op so that torch.compile keeps
    it opaque."""
    return run_plan(lengths, window, default_config(kv_heads, head_dim, lengths.device))


@paged_decode_plan.register_fake
def _(lengths, window, kv_heads, head_dim):
    rows = lengths.shape[0]
    config = default_config(kv_heads, head_dim, lengths.device)
    items = lengths.new_empty(max_items(rows, config), 3, dtype=torch.int32)
    return items, lengths.new_empty(rows, 2, dtype=torch.int32)


@torch.library.custom_op("graphserve::paged_decode", mutates_args=(), device_types="cuda")
def paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    slot_ids: torch.Tensor,
    items: torch.Tensor,
    row_chunks: torch.Tensor,
) -> torch.Tensor:
    """q (rows, heads, head_dim) -> (rows, heads * head_dim). k_pages/v_pages: one layer's pool
    (num_pages, page_size, kv_heads, head_dim); row r reads block_table[slot_ids[r]] over the key
    ranges its items give (`paged_decode_plan`: up to its length, the last W keys with a sliding
    window). A custom op so that torch.compile keeps it opaque instead of tracing into the launches."""
    config = default_config(k_pages.shape[2], q.shape[2], q.device)
    return run_attention(q, k_pages, v_pages, block_table, slot_ids, (items, row_chunks), config)


@paged_decode.register_fake
def _(q, k_pages, v_pages, block_table, slot_ids, items, row_chunks):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def paged_decode_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    slot_ids: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """The same result in plain torch, for tests and as the baseline: gathers every row's whole
    block-table row (its cost follows the table width, not the live length) and masks by length."""
    rows, heads, dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    pages = block_table.index_select(0, slot_ids).long()
    num_keys = pages.shape[1] * page_size

    def gather(pool: torch.Tensor) -> torch.Tensor:  # (rows, kv_heads, num_keys, head_dim)
        return pool[pages].view(rows, num_keys, kv_heads, dim).transpose(1, 2)

    key = torch.arange(num_keys, device=q.device)[None, :]
    position = lengths.long()[:, None] - 1
    visible = (key <= position) & (key > position - (window or NO_WINDOW))
    # GQA without copying K/V: the query heads sharing one KV head become its query rows.
    out = F.scaled_dot_product_attention(
        q.view(rows, kv_heads, heads // kv_heads, dim),
        gather(k_pages),
        gather(v_pages),
        attn_mask=visible[:, None, None, :],
    )
    return out.reshape(rows, heads * dim)
