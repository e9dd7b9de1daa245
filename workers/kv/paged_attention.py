"""Split-KV paged decode attention in Triton: one query token per row, keys and values read from the
paged KV cache through the block table, and only as far as each row's live length.

Why split-KV: a decode batch has rows * kv_heads independent (row, KV head) problems, too few to keep
an H200's SMs busy when the batch is small, so each row's live range is also cut into `num_splits`
chunks, one program each; a second kernel merges the chunks' partial outputs by their log-sum-exp.
Each program serves all `group` query heads of its KV head as one tile, so K/V are read once.

Why it can be captured in a CUDA graph: the launch grid depends only on static shapes (rows,
kv_heads, the table width) and the SM count. Each program derives its chunk from the row's live
length on the device, so one graph stays right as lengths, block table and queries change in place,
and the work follows the live lengths, not the table width: a split past a short row's end writes
only a neutral log-sum-exp (-inf) and exits.

Why these defaults (bench/paged_attention_kernel.py, bench/results/paged_attention_kernel_h200.md):
- BLOCK_N 64, 4 warps, 2 stages: of six (BLOCK_N, warps, stages) swept, each at its best split
  count, the fastest or within 4% of it at 12 of 14 batch shapes; at the other two (one row of 256
  tokens, ~6 us, launch-bound) BLOCK_N 16 is 0.3-0.7 us faster, but up to 1.6x slower at long
  contexts. 32 tokens on 2 warps is within 5%; 8 warps with 3 stages loses up to 1.3x.
- num_splits: at 4096 tokens of context the best count gave each SM about 4 programs of the 8B
  shape (head_dim 128: 8, 32, 64 rows -> 8, 2, 1 splits) and about 8 of the 1B shape, whose
  programs read half the bytes (1, 8, 32, 64 rows -> 32, 16, 4, 2); the rule picks those. For one
  row of 8B the cap below keeps 32 splits (13.0 us; 64 gave 12.5). Fewer leave SMs idle (8B, 1 row:
  125 us at 1 split); more cost programs and a longer reduce (8B, 256 rows of 256 tokens: 82 us at
  1 split, 188 at 16). Capped so a full-length row's chunks keep 256 tokens. The count cannot
  follow the live lengths; on short rows its extra splits exit at once (8B, 1 row of 256 tokens:
  7.2 us at the rule's 32 splits, 6.8 at the best, 4, in the sweep).
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
NO_WINDOW = 1 << 30  # a window longer than any sequence: the kernel takes an int, not None
PROGRAMS_PER_SM = 4  # programs (row, kv head, split) per SM at head_dim 128; twice as many at 64
MIN_CHUNK = 256  # never split a full-length row into chunks shorter than this many tokens


def available() -> bool:
    """Whether the kernel can run here: triton imports and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


@dataclass(frozen=True)
class SplitConfig:
    num_splits: int
    block_n: int = 64  # tokens per inner step: at least 16 (tl.dot), a power of two
    num_warps: int = 4
    num_stages: int = 2


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(
    rows: int, kv_heads: int, head_dim: int, max_pages: int, page_size: int, device: torch.device
) -> SplitConfig:
    """The launch for a batch shape: from static shapes and the SM count only, never from the lengths
    (no host sync, so a captured graph keeps it)."""
    programs = PROGRAMS_PER_SM * _sm_count(device.index) * 128 // head_dim
    return SplitConfig(num_splits=max(1, min(programs // (rows * kv_heads), max_pages * page_size // MIN_CHUNK)))


if triton is not None:

    @triton.jit
    def _split_kernel(
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
        DOT_PRECISION: tl.constexpr,
    ):
        """One (row, KV head, split): online softmax over the split's chunk of the row's live keys, in
        log2 units. Writes the normalised partial output and its log-sum-exp per query head."""
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

        # An empty chunk (a split past the row's end) writes only lse = -inf: weight 0, output never read.
        nonempty = total > 0
        part = (row * tl.num_programs(1) * group + heads) * num_splits + split
        tl.store(part_lse_ptr + part, tl.where(nonempty, m + tl.log2(total), float("-inf")), mask=real_head)
        out_mask = (real_head & nonempty)[:, None]
        tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], acc / total[:, None], mask=out_mask)

    @triton.jit
    def _reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, D: tl.constexpr, SPLITS_PAD: tl.constexpr):
        """One (row, query head): the nonempty splits' partials weighted by exp2(lse - max lse)."""
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


def run_kernel(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    slot_ids: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None,
    config: SplitConfig,
) -> torch.Tensor:
    """The two launches with an explicit config (`paged_decode` picks `default_config`)."""
    rows, heads, dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    assert heads % kv_heads == 0 and k_pages.stride() == v_pages.stride() and q.stride(2) == 1
    group, splits = heads // kv_heads, config.num_splits
    part_out = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    _split_kernel[(rows, kv_heads, splits)](
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
        window or NO_WINDOW,
        LOG2E / math.sqrt(dim),
        D=dim,
        PAGE=page_size,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=config.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    out = q.new_empty(rows, heads * dim)
    _reduce_kernel[(rows * heads,)](part_out, part_lse, out, splits, D=dim, SPLITS_PAD=triton.next_power_of_2(splits))
    return out


@torch.library.custom_op("graphserve::paged_decode", mutates_args=(), device_types="cuda")
def paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    slot_ids: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """q (rows, heads, head_dim) -> (rows, heads * head_dim). k_pages/v_pages: one layer's pool
    (num_pages, page_size, kv_heads, head_dim); row r reads block_table[slot_ids[r]] up to
    lengths[r] keys (the last W of them with a sliding window). A custom op so that torch.compile
    keeps it opaque instead of tracing into the Triton launch."""
    rows, _, head_dim = q.shape
    config = default_config(rows, k_pages.shape[2], head_dim, block_table.shape[1], k_pages.shape[1], q.device)
    return run_kernel(q, k_pages, v_pages, block_table, slot_ids, lengths, window, config)


@paged_decode.register_fake
def _(q, k_pages, v_pages, block_table, slot_ids, lengths, window):
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
