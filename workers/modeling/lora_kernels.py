"""Batched LoRA for decode in Triton: BGMV for few rows, SGMV-style slot groups for more (as in Punica).

The matmul-and-mask form in `lora.py` multiplies every row by every slot and masks: its cost follows
max_loras x max_lora_rank, in three to five launches per layer. Here two launches do a layer whatever
the mix: `shrink` computes s = A[slot] x for each (row, part), split along the input features so a
small batch still spreads over the SMs; `expand` adds B[slot] s into the layer's output, each output
feature reading its part's s. A row naming slot 0 (no adapter, or a padding row) costs a load of its
slot index and a copy of its output row.

Two ways to share the work out. Per row (BGMV), below `SLOT_GROUP_ROWS` rows: each program takes one
row, so each row reads its slot's A and B on its own, reads that grow with the rows. Per slot (the
SGMV idea, without sorting rows): each program takes one slot and every row naming it, reads that
slot's A or B tile once and multiplies it against those rows with `tl.dot`; programs of slots no row
names return at once. Both write each output once and add in a fixed order, so a replay computes
bit for bit what eager computes. Long prefills take the matmul form (`MAX_ROWS`).

Both are custom ops, so torch.compile keeps them opaque, and both have a fixed launch grid for
given shapes, so CUDA graphs capture them; which slot a row reads is read on the device.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, `available()` says False
    triton = None

MAX_ROWS = 64  # rows up to which a call takes these kernels (chosen for decode batches, not swept)
SLOT_GROUP_ROWS = 32  # rows from which programs take a slot each (measured: bench/results/lora_kernels.md)
TILE = 4096  # elements of one program's A tile: rank x input features
MAX_SPLITS = 64  # shrink programs per (row, part), each one tile wide or a few when capped
GROUP_TILE = 8192  # elements of a slot program's x tile: rows x input features
GROUP_SPLITS = 8  # shrink programs per (slot, part): expand adds up every split's partial sums at once
BLOCK_O = 128  # output features per expand program


def available() -> bool:
    """Whether the kernels can run here: triton imports and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


def by_slot(rows: int) -> bool:
    return rows >= SLOT_GROUP_ROWS


def shrink_shape(in_features: int, rank: int, rows: int) -> tuple[int, int, int]:
    """(splits, features per split, features per load). Per row: one load per program when the cap
    allows, so a program's time is one load's latency, not a chain of them. Per slot: few splits,
    since every expand program adds up all of them for all its rows."""
    if by_slot(rows):
        block_k = max(16, GROUP_TILE // _dot_size(rows))
        n = min(GROUP_SPLITS, triton.cdiv(in_features, block_k))
    else:
        block_k = max(16, TILE // triton.next_power_of_2(rank))
        n = min(MAX_SPLITS, triton.cdiv(in_features, block_k))
    return n, triton.cdiv(triton.cdiv(in_features, n), block_k) * block_k, block_k


def _dot_size(n: int) -> int:
    """A block size tl.dot takes: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))


if triton is not None:

    @triton.jit
    def _shrink_kernel(
        x_ptr, a_ptr, adapters_ptr, out_ptr, in_features, stride_x, rows, max_loras, split_len,
        RANK: tl.constexpr, RANK_PAD: tl.constexpr, PARTS: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One (row, part, split): the part's slot rows of A times the split's input features."""
        row = tl.program_id(0)
        part = tl.program_id(1)
        split = tl.program_id(2)
        slot = tl.load(adapters_ptr + row).to(tl.int64)
        if slot > 0:
            j = tl.arange(0, RANK_PAD)
            a_rows = (part * max_loras + slot - 1) * RANK + j
            acc = tl.zeros([RANK_PAD], tl.float32)
            lo = split * split_len
            for k in range(lo, lo + split_len, BLOCK_K):
                kk = k + tl.arange(0, BLOCK_K)
                inside = kk < in_features
                x = tl.load(x_ptr + row * stride_x + kk, mask=inside, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + a_rows[:, None] * in_features + kk[None, :],
                            mask=(j[:, None] < RANK) & inside[None, :], other=0.0)  # fmt: skip
                acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
            tl.store(out_ptr + (split * rows + row) * (PARTS * RANK) + part * RANK + j, acc, mask=j < RANK)

    @triton.jit
    def _expand_kernel(
        y_ptr, out_ptr, s_ptr, b_ptr, row_part_ptr, adapters_ptr, out_features, stride_y, rows, max_loras,
        num_splits, RANK: tl.constexpr, RANK_PAD: tl.constexpr, PARTS: tl.constexpr, SPLITS_PAD: tl.constexpr,
        BLOCK_O: tl.constexpr,
    ):  # fmt: skip
        """One (row, tile of output features): y + B[slot] s, each feature with its part's s."""
        row = tl.program_id(0)
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        in_row = o < out_features
        y = tl.load(y_ptr + row * stride_y + o, mask=in_row, other=0.0)
        slot = tl.load(adapters_ptr + row).to(tl.int64)
        result = y.to(tl.float32)
        if slot > 0:
            part = tl.load(row_part_ptr + o, mask=in_row, other=-1)
            j = tl.arange(0, RANK_PAD)
            split = tl.arange(0, SPLITS_PAD)
            partial = s_ptr + (split[:, None] * rows + row) * (PARTS * RANK) + j[None, :]
            used = (split[:, None] < num_splits) & (j[None, :] < RANK)
            s = tl.zeros([BLOCK_O, RANK_PAD], tl.float32)
            for p in tl.static_range(PARTS):  # each part's s: its splits' partial sums added
                sp = tl.sum(tl.load(partial + p * RANK, mask=used, other=0.0), axis=0)
                s = tl.where((part == p)[:, None], sp[None, :], s)
            adapted = (part >= 0)[:, None] & (j < RANK)[None, :]
            b = tl.load(b_ptr + o[:, None] * (max_loras * RANK) + (slot - 1) * RANK + j[None, :], mask=adapted,
                        other=0.0)  # fmt: skip
            result += tl.sum(b.to(tl.float32) * s, axis=1)
        tl.store(out_ptr + row * stride_y + o, result.to(y.dtype), mask=in_row)

    @triton.jit
    def _slot_shrink_kernel(
        x_ptr, a_ptr, adapters_ptr, out_ptr, in_features, stride_x, rows, max_loras, split_len,
        RANK: tl.constexpr, RANK_PAD: tl.constexpr, PARTS: tl.constexpr, ROWS_PAD: tl.constexpr,
        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One (slot, part, split): the part's slot rows of A times the split of every row naming the slot."""
        slot = tl.program_id(0) + 1
        part = tl.program_id(1)
        split = tl.program_id(2)
        r = tl.arange(0, ROWS_PAD)
        mine = tl.load(adapters_ptr + r, mask=r < rows, other=0) == slot
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            j = tl.arange(0, RANK_PAD)
            a_rows = (part * max_loras + slot - 1).to(tl.int64) * RANK + j
            acc = tl.zeros([ROWS_PAD, RANK_PAD], tl.float32)
            lo = split * split_len
            for k in range(lo, lo + split_len, BLOCK_K):
                kk = k + tl.arange(0, BLOCK_K)
                inside = kk < in_features
                x = tl.load(x_ptr + r[:, None] * stride_x + kk[None, :], mask=mine[:, None] & inside[None, :],
                            other=0.0)  # fmt: skip
                a = tl.load(a_ptr + a_rows[:, None] * in_features + kk[None, :],
                            mask=(j[:, None] < RANK) & inside[None, :], other=0.0)  # fmt: skip
                acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
            out = out_ptr + (split * rows + r[:, None]) * (PARTS * RANK) + part * RANK + j[None, :]
            tl.store(out, acc, mask=mine[:, None] & (j[None, :] < RANK))

    @triton.jit
    def _slot_expand_kernel(
        y_ptr, out_ptr, s_ptr, b_ptr, row_part_ptr, adapters_ptr, out_features, stride_y, rows, max_loras,
        num_splits, RANK: tl.constexpr, RANK_PAD: tl.constexpr, PARTS: tl.constexpr, SPLITS_PAD: tl.constexpr,
        ROWS_PAD: tl.constexpr, BLOCK_O: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One (slot, tile of output features) for every row naming the slot: y + B[slot] s, each
        feature with its part's s; slot 0's program copies its rows."""
        slot = tl.program_id(0)
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        in_row = o < out_features
        r = tl.arange(0, ROWS_PAD)
        mine = tl.load(adapters_ptr + r, mask=r < rows, other=-1) == slot
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            at = r[:, None] * stride_y + o[None, :]
            y = tl.load(y_ptr + at, mask=mine[:, None] & in_row[None, :], other=0.0)
            result = y.to(tl.float32)
            if slot > 0:
                part = tl.load(row_part_ptr + o, mask=in_row, other=-1)
                j = tl.arange(0, RANK_PAD)
                b = tl.load(b_ptr + o[:, None] * (max_loras * RANK) + (slot - 1).to(tl.int64) * RANK + j[None, :],
                            mask=in_row[:, None] & (j[None, :] < RANK), other=0.0)  # fmt: skip
                split = tl.arange(0, SPLITS_PAD)
                partial = s_ptr + (split[:, None, None] * rows + r[None, :, None]) * (PARTS * RANK) + j[None, None, :]
                used = (split[:, None, None] < num_splits) & mine[None, :, None] & (j[None, None, :] < RANK)
                for p in tl.static_range(PARTS):  # each part present in the tile: its splits' sums, times its B
                    here = part == p
                    if tl.max(here.to(tl.int32), axis=0) > 0:
                        s = tl.sum(tl.load(partial + p * RANK, mask=used, other=0.0), axis=0)
                        b_part = tl.trans(tl.where(here[:, None], b.to(tl.float32), 0.0))
                        result += tl.dot(s, b_part, input_precision=PRECISION)  # tf32: exact for B, 10 bits of s
            tl.store(out_ptr + at, result.to(y.dtype), mask=mine[:, None] & in_row[None, :])


@torch.library.custom_op("graphserve::lora_shrink", mutates_args=(), device_types="cuda")
def lora_shrink(x: torch.Tensor, a: torch.Tensor, adapters: torch.Tensor, parts: int, max_loras: int) -> torch.Tensor:
    """x (rows, in), A (parts * max_loras * rank, in) -> (splits, rows, parts * rank) fp32 partial
    sums; rows naming slot 0 are left unwritten (expand never reads them)."""
    rows, in_features = x.shape
    rank = a.shape[0] // (parts * max_loras)
    n, split_len, block_k = shrink_shape(in_features, rank, rows)
    out = torch.empty(n, rows, parts * rank, dtype=torch.float32, device=x.device)
    if by_slot(rows):
        _slot_shrink_kernel[(max_loras, parts, n)](
            x, a, adapters, out, in_features, x.stride(0), rows, max_loras, split_len,
            RANK=rank, RANK_PAD=_dot_size(rank), PARTS=parts, ROWS_PAD=_dot_size(rows), BLOCK_K=block_k,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        )  # fmt: skip
    else:
        _shrink_kernel[(rows, parts, n)](
            x, a, adapters, out, in_features, x.stride(0), rows, max_loras, split_len,
            RANK=rank, RANK_PAD=triton.next_power_of_2(rank), PARTS=parts, BLOCK_K=block_k,
        )  # fmt: skip
    return out


@lora_shrink.register_fake
def _(x, a, adapters, parts, max_loras):
    rank = a.shape[0] // (parts * max_loras)
    return x.new_empty(shrink_shape(x.shape[1], rank, x.shape[0])[0], x.shape[0], parts * rank, dtype=torch.float32)


@torch.library.custom_op("graphserve::lora_expand", mutates_args=(), device_types="cuda")
def lora_expand(
    y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, row_part: torch.Tensor, adapters: torch.Tensor
) -> torch.Tensor:
    """y (rows, out) + each row's B[slot] s: B (out, max_loras, rank), row_part (out,) the part of
    each output feature (-1: a part no adapter targets), s from `lora_shrink`. A new tensor, so the
    op mutates nothing and torch.compile needs no copy of y."""
    rows, out_features = y.shape
    _, max_loras, rank = b.shape
    num_splits, _, width = s.shape
    out = torch.empty_like(y)
    tiles = triton.cdiv(out_features, BLOCK_O)
    if by_slot(rows):
        _slot_expand_kernel[(max_loras + 1, tiles)](
            y, out, s, b, row_part, adapters, out_features, y.stride(0), rows, max_loras, num_splits,
            RANK=rank, RANK_PAD=_dot_size(rank), PARTS=width // rank, SPLITS_PAD=triton.next_power_of_2(num_splits),
            ROWS_PAD=_dot_size(rows), BLOCK_O=BLOCK_O, PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        )  # fmt: skip
    else:
        _expand_kernel[(rows, tiles)](
            y, out, s, b, row_part, adapters, out_features, y.stride(0), rows, max_loras, num_splits,
            RANK=rank, RANK_PAD=triton.next_power_of_2(rank), PARTS=width // rank,
            SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_O=BLOCK_O,
        )  # fmt: skip
    return out


@lora_expand.register_fake
def _(y, s, b, row_part, adapters):
    return torch.empty_like(y)
