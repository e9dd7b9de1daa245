"""Applying grammar token bitmasks to logits: the torch ops every device without the kernel runs,
against a bit-by-bit reference, and the Triton kernel (`workers/serving/token_mask.py`, run here by
Triton's interpreter on CPU) against the torch ops."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from workers.serving.sampling_ops import apply_token_bitmask

# (logits width, bitmask words): a bitmask as wide as the logits, one narrower (a padded
# vocabulary: the columns past it are never allowed), one wider, and the real 1B shape
SHAPES = [(64, 2), (70, 2), (100, 1), (90, 5), (128256, 4008)]


def reference(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """Token by token: column c of row rows[i] stays only where bit c % 32 of word c // 32 is set."""
    out = logits.clone()
    words = bitmask.tolist()
    for i, row in enumerate(rows):
        for column in range(logits.shape[1]):
            word = column // 32
            if word >= len(words[i]) or not (words[i][word] >> (column % 32)) & 1:
                out[row, column] = float("-inf")
    return out


def random_case(width: int, words: int, seed: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Six rows of logits, three of them (out of order) under random bitmasks."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, width, generator=g)
    bitmask = torch.randint(-(2**31), 2**31, (3, words), dtype=torch.int32, generator=g)
    bitmask[0, 0] = -1  # every bit, the sign bit included
    bitmask[1, -1] = -(2**31)  # the sign bit alone
    return logits, [4, 0, 2], bitmask


@pytest.mark.parametrize(("width", "words"), SHAPES[:4])
def test_the_torch_ops_ban_what_the_bits_leave_out_and_touch_no_other_row(width, words):
    logits, rows, bitmask = random_case(width, words, seed=width)
    before = logits.clone()
    out = apply_token_bitmask(logits, torch.tensor(rows), bitmask)
    assert out is logits  # in place
    assert torch.equal(out, reference(before, rows, bitmask))
    for free in (1, 3, 5):
        assert torch.equal(out[free], before[free])


def test_the_bitmask_rows_are_picked_by_index():
    """The sampler keeps a bitmask row per slot: row masks[i] is logits row rows[i]'s."""
    logits, rows, bitmask = random_case(70, 3, seed=2)
    spare = torch.randint(-(2**31), 2**31, (2, 3), dtype=torch.int32, generator=torch.Generator().manual_seed(9))
    by_slot = torch.cat([spare[:1], bitmask[2:], bitmask[:1], spare[1:], bitmask[1:2]])  # rows 1, 2 and 4 used
    masks = torch.tensor([2, 4, 1])
    expected = reference(logits, rows, bitmask)
    assert torch.equal(apply_token_bitmask(logits, torch.tensor(rows), by_slot, masks), expected)


def test_a_bitmask_of_every_bit_changes_nothing():
    logits, rows, bitmask = random_case(128256, 4008, seed=1)
    before = logits.clone()
    apply_token_bitmask(logits, torch.tensor(rows), torch.full_like(bitmask, -1))
    assert torch.equal(logits, before)


KERNEL_CHECK = """
import torch
from workers.serving import token_mask
from workers.serving.sampling_ops import apply_token_bitmask
from tests.unit.test_token_mask import SHAPES, random_case

for width, words in SHAPES:
    logits, rows, bitmask = random_case(width, words, seed=width)
    kernel, ops = logits.clone(), logits.clone()
    token_mask.ban(kernel, torch.tensor(rows, dtype=torch.int32), bitmask)
    apply_token_bitmask(ops, torch.tensor(rows), bitmask)
    assert torch.equal(kernel, ops), (width, words)
    assert torch.isinf(kernel).sum() > 0
    masks = torch.tensor([1, 2, 0], dtype=torch.int32)  # bitmask rows picked by index
    kernel, ops = logits.clone(), logits.clone()
    token_mask.ban(kernel, torch.tensor(rows, dtype=torch.int32), bitmask, masks)
    apply_token_bitmask(ops, torch.tensor(rows), bitmask, masks)
    assert torch.equal(kernel, ops), (width, words, "masks")
print("same")
"""


def test_the_kernel_bans_what_the_torch_ops_ban():
    """The interpreter is chosen when triton.jit decorates, so it runs in a process of its own."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KERNEL_CHECK)],
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-3000:]
