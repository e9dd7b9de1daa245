"""LoRA's expand for decode in Triton: BGMV for few rows, SGMV-style slot programs for more (as in Punica).

The shrink, s = A[slot] x, needs no kernel of its own: an adapted layer keeps its slots of A as
extra rows under its weight (`LinearLora`), so the layer's GEMM gives y and every slot's s in one
launch, reading A's bytes once. What is left is one launch per layer whatever the mix of adapters:
`expand` adds B[slot] s[slot] to each row of y, each output feature taking its part's s. A row
naming slot 0 (no adapter, or a padding row) costs a load of its slot index and a copy of its row.

Two ways to share the work out. Per row (BGMV), below `SLOT_GROUP_ROWS` rows: each program takes
one row and a tile of output features, so each row reads its slot's B on its own, reads that grow
with the rows. Per slot (the SGMV idea, without sorting rows): each program takes one slot, a tile
and every row naming the slot, reads that slot's B tile once and multiplies it against those rows
with `tl.dot`; programs of slots no row names return at once. Both write each output once, so a
replay computes bit for bit what eager computes. Long prefills take the matmul form (`MAX_ROWS`).

The op is custom, so torch.compile keeps it opaque, and its launch grid is fixed for given shapes,
so CUDA graphs capture it; which slot a row reads is read on the device.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, `available()` says False
    triton = None

MAX_ROWS = 64  # rows up to which a call takes the kernel (chosen for decode batches, not swept)
SLOT_GROUP_ROWS = 32  # rows from which programs take a slot each (measured: bench/results/lora_kernels.md)
BLOCK_O = 128  # output features per program


def available() -> bool:
    """Whether the kernels can run here: triton imports and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


def _dot_size(n: int) -> int:
    """A block size tl.dot takes: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))


if triton is not None:

    @triton.jit
    def _expand_kernel(
        y_ptr,
        s_ptr,
        b_ptr,
        out_ptr,
        row_part_ptr,
        adapters_ptr,
        out_features,
        stride_y,
        stride_s,
        stride_out,
        max_loras,
        RANK: tl.constexpr,
        RANK_PAD: tl.constexpr,
        PARTS: tl.constexpr,
        BLOCK_O: tl.constexpr,
    ):
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
            s = tl.zeros([BLOCK_O, RANK_PAD], tl.float32)
            for p in tl.static_range(PARTS):
                sp = tl.load(s_ptr + row * stride_s + (p * max_loras + slot - 1) * RANK + j, mask=j < RANK, other=0.0)
                s = tl.where((part == p)[:, None], sp.to(tl.float32)[None, :], s)
            adapted = (part >= 0)[:, None] & (j < RANK)[None, :]
            b = tl.load(
                b_ptr + o[:, None] * (max_loras * RANK) + (slot - 1) * RANK + j[None, :], mask=adapted, other=0.0
            )
            result += tl.sum(b.to(tl.float32) * s, axis=1)
        tl.store(out_ptr + row * stride_out + o, result.to(y.dtype), mask=in_row)

    @triton.jit
    def _slot_expand_kernel(
        y_ptr,
        s_ptr,
        b_ptr,
        out_ptr,
        row_part_ptr,
        adapters_ptr,
        out_features,
        stride_y,
        stride_s,
        stride_out,
        rows,
        max_loras,
        RANK: tl.constexpr,
        RANK_PAD: tl.constexpr,
        PARTS: tl.constexpr,
        ROWS_PAD: tl.constexpr,
        BLOCK_O: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One (slot, tile of output features) for every row naming the slot: y + B[slot] s, each
        feature with its part's s; slot 0's program copies its rows."""
        slot = tl.program_id(0)
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        in_row = o < out_features
        r = tl.arange(0, ROWS_PAD)
        mine = tl.load(adapters_ptr + r, mask=r < rows, other=-1) == slot
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            y = tl.load(y_ptr + r[:, None] * stride_y + o[None, :], mask=mine[:, None] & in_row[None, :], other=0.0)
            result = y.to(tl.float32)
            if slot > 0:
                part = tl.load(row_part_ptr + o, mask=in_row, other=-1)
                j = tl.arange(0, RANK_PAD)
                for p in tl.static_range(PARTS):  # each part present in the tile: its rows' s times its B
                    here = part == p
                    if tl.max(here.to(tl.int32), axis=0) > 0:
                        s = tl.load(
                            s_ptr + r[:, None] * stride_s + (p * max_loras + slot - 1) * RANK + j[None, :],
                            mask=mine[:, None] & (j[None, :] < RANK),
                            other=0.0,
                        )
                        b = tl.load(
                            b_ptr + o[:, None] * (max_loras * RANK) + (slot - 1).to(tl.int64) * RANK + j[None, :],
                            mask=here[:, None] & (j[None, :] < RANK),
                            other=0.0,
                        )
                        result += tl.dot(s, tl.trans(b), input_precision=PRECISION)
            at = r[:, None] * stride_out + o[None, :]
            tl.store(out_ptr + at, result.to(y.dtype), mask=mine[:, None] & in_row[None, :])


@torch.library.custom_op("graphserve::lora_expand", mutates_args=(), device_types="cuda")
def lora_expand(
    y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, row_part: torch.Tensor, adapters: torch.Tensor
) -> torch.Tensor:
    """y (rows, out) + each row's B[slot] s[slot], as a new tensor (so the op mutates nothing and
    torch.compile needs no copy of y). s (rows, parts * max_loras * rank): every slot's A x, part
    by part; B (out, max_loras, rank); row_part (out,) the part of each output feature (-1: a part
    no adapter targets). y and s may be column slices of one GEMM's output."""
    y, s = (t if t.stride(-1) == 1 else t.contiguous() for t in (y, s))
    rows, out_features = y.shape
    _, max_loras, rank = b.shape
    parts = s.shape[1] // (max_loras * rank)
    out = y.new_empty(rows, out_features)
    tiles = triton.cdiv(out_features, BLOCK_O)
    strides = (y.stride(0), s.stride(0), out.stride(0))
    if rows >= SLOT_GROUP_ROWS:
        _slot_expand_kernel[(max_loras + 1, tiles)](
            y,
            s,
            b,
            out,
            row_part,
            adapters,
            out_features,
            *strides,
            rows,
            max_loras,
            RANK=rank,
            RANK_PAD=_dot_size(rank),
            PARTS=parts,
            ROWS_PAD=_dot_size(rows),
            BLOCK_O=BLOCK_O,
            PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        )
    else:
        _expand_kernel[(rows, tiles)](
            y,
            s,
            b,
            out,
            row_part,
            adapters,
            out_features,
            *strides,
            max_loras,
            RANK=rank,
            RANK_PAD=triton.next_power_of_2(rank),
            PARTS=parts,
            BLOCK_O=BLOCK_O,
        )
    return out


@lora_expand.register_fake
def _(y, s, b, row_part, adapters):
    return y.new_empty(y.shape)
