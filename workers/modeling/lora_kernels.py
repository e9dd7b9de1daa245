"""Batched LoRA for decode in Triton (BGMV, as in Punica): each row reads only its own adapter's slot.

The matmul-and-mask form in `lora.py` multiplies every row by every slot and masks: its cost follows
max_loras x max_lora_rank, in three to five launches per layer. Here two launches do a layer whatever
the mix: `shrink` computes s = A[slot] x for each (row, part), split along the input features so a
small batch still spreads over the SMs (one load per program, not a chain of them); `expand` adds
B[slot] s into the layer's output, each output feature reading its part's s. A row naming slot 0
(no adapter, or a padding row) costs a load of its slot index and a copy of its output row.

Why only for few rows: each row reads its slot's B on its own, so the reads grow with the rows
(mostly from L2, rows of one adapter share them), while the matmul form reads every slot's B once.
Decode batches are small; long prefills take the matmul form (`MAX_ROWS`).

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
TILE = 4096  # elements of one program's A tile: rank x input features
MAX_SPLITS = 64  # shrink programs per (row, part), each one tile wide or a few when capped
BLOCK_O = 128  # output features per expand program


def available() -> bool:
    """Whether the kernels can run here: triton imports and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


def shrink_shape(in_features: int, rank: int) -> tuple[int, int, int]:
    """(splits, features per split, features per load): one load per program when the cap allows,
    so a program's time is one load's latency, not a chain of them."""
    block_k = max(16, TILE // triton.next_power_of_2(rank))
    n = min(MAX_SPLITS, triton.cdiv(in_features, block_k))
    return n, triton.cdiv(triton.cdiv(in_features, n), block_k) * block_k, block_k


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


@torch.library.custom_op("graphserve::lora_shrink", mutates_args=(), device_types="cuda")
def lora_shrink(x: torch.Tensor, a: torch.Tensor, adapters: torch.Tensor, parts: int, max_loras: int) -> torch.Tensor:
    """x (rows, in), A (parts * max_loras * rank, in) -> (splits, rows, parts * rank) fp32 partial
    sums; rows naming slot 0 are left unwritten (expand never reads them)."""
    rows, in_features = x.shape
    rank = a.shape[0] // (parts * max_loras)
    n, split_len, block_k = shrink_shape(in_features, rank)
    out = torch.empty(n, rows, parts * rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(rows, parts, n)](
        x, a, adapters, out, in_features, x.stride(0), rows, max_loras, split_len,
        RANK=rank, RANK_PAD=triton.next_power_of_2(rank), PARTS=parts, BLOCK_K=block_k,
    )  # fmt: skip
    return out


@lora_shrink.register_fake
def _(x, a, adapters, parts, max_loras):
    rank = a.shape[0] // (parts * max_loras)
    return x.new_empty(shrink_shape(x.shape[1], rank)[0], x.shape[0], parts * rank, dtype=torch.float32)


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
    _expand_kernel[(rows, triton.cdiv(out_features, BLOCK_O))](
        y, out, s, b, row_part, adapters, out_features, y.stride(0), rows, max_loras, num_splits,
        RANK=rank, RANK_PAD=triton.next_power_of_2(rank), PARTS=width // rank,
        SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_O=BLOCK_O,
    )  # fmt: skip
    return out


@lora_expand.register_fake
def _(y, s, b, row_part, adapters):
    return torch.empty_like(y)
