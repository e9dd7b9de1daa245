"""Grammar token bitmasks applied to the logits in one Triton launch (CUDA; `sampling_ops.py` has the
plain-torch form every other device runs, and the tests hold the two to the same result).

Why a kernel: unpacking the packed int32 words with torch ops takes about seven launches (shift,
and, compare, gather of the rows, masked_fill, and an index_put that copies the whole logits),
each reading and writing a tensor as wide as the vocabulary (16 MB apiece at 32 rows of 128k
logits), and each a host launch of its own. Here each program takes one constrained row
and a tile of its words, reads the row's index, the index of its bitmask row and those words, and
writes -inf over the banned logits in place: nothing else is read or written, and rows no grammar
holds are never touched. The bitmask rows are picked by index (the sampler keeps one per sequence
slot, filled ahead of the step), so they need not be in the order of the logits rows.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, `available()` says False
    triton = None

WORDS_PER_PROGRAM = 128  # 4096 logits per program: 32 programs over a 128k vocabulary


def available(logits: torch.Tensor) -> bool:
    """Whether the kernel can take these logits: on CUDA with triton, columns contiguous."""
    return triton is not None and logits.is_cuda and logits.stride(1) == 1


if triton is not None:
    # the sizes and strides are the same every step of an engine: not specialized, so the warm-up's
    # compile is the one serving uses whatever their values
    @triton.jit(do_not_specialize=["width", "words", "logits_stride", "mask_stride"])
    def _ban_kernel(
        logits_ptr,
        rows_ptr,
        masks_ptr,
        mask_ptr,
        width,
        words,
        logits_stride,
        mask_stride,
        WORDS: tl.constexpr,
    ):
        """One (constrained row, tile of WORDS words): -inf where the word's bit is 0, and for every
        column past the bitmask's words (they load as 0)."""
        i = tl.program_id(0)
        w = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
        row = tl.load(rows_ptr + i).to(tl.int64)
        mask_row = tl.load(masks_ptr + i).to(tl.int64)
        bits = tl.load(mask_ptr + mask_row * mask_stride + w, mask=w < words, other=0)
        shift = tl.arange(0, 32)
        banned = ((bits[:, None] >> shift[None, :]) & 1) == 0
        column = w[:, None] * 32 + shift[None, :]
        inf = tl.full([WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + row * logits_stride + column, inf, mask=banned & (column < width))


def ban(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, masks: torch.Tensor | None = None) -> None:
    """In place: logits[rows[i]] gets -inf wherever bitmask row masks[i] (default: row i) does not
    allow the token (int32 rows and masks; bitmask int32 (rows, words), its rows contiguous)."""
    if masks is None:
        masks = torch.arange(rows.shape[0], dtype=torch.int32, device=rows.device)
    width = logits.shape[1]
    grid = (rows.shape[0], triton.cdiv(triton.cdiv(width, 32), WORDS_PER_PROGRAM))
    _ban_kernel[grid](
        logits,
        rows,
        masks,
        bitmask,
        width,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        WORDS=WORDS_PER_PROGRAM,
    )
