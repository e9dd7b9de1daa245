"""The LoRA decode kernels (`lora_kernels.py`) against the same sum in fp32 torch, on fresh random
slots: odd row counts on both sides of `SLOT_GROUP_ROWS` (programs per row, programs per slot), rows
without an adapter, fused layers with an untargeted part, ranks that are not powers of two, input
widths that split unevenly; and LinearLora's two forms agree."""

from __future__ import annotations

import pytest
import torch

from workers.modeling import lora_kernels
from workers.modeling.lora import LinearLora, LoraBatch
from workers.tensor_parallel.parallel import ColumnParallelLinear, TPGroup

pytestmark = pytest.mark.gpu


def reference(y, x, a, b, row_part, adapters, parts, max_loras):
    """y + B[slot] (A[slot, part] x) for each row and output feature, in fp32."""
    rank = b.shape[2]
    out = y.float().clone()
    for r, slot in enumerate(adapters.tolist()):
        if slot == 0:
            continue
        s = torch.stack([a[(p * max_loras + slot - 1) * rank : (p * max_loras + slot) * rank].float() @ x[r].float()
                         for p in range(parts)])  # fmt: skip
        for o in range(y.shape[1]):
            p = int(row_part[o])
            if p >= 0:
                out[r, o] += b[o, slot - 1].float() @ s[p]
    return out


@pytest.mark.parametrize(
    ("rows", "in_features", "part_sizes", "rank", "max_loras"),
    [(1, 4096, (48, 16, 16), 16, 8), (3, 200, (40, -24, 40), 12, 3), (7, 3000, (64, 64), 64, 2),
     (32, 1536, (96,), 8, 4), (64, 128, (16, 16, 16), 4, 5), (15, 4096, (48, -16, 80), 16, 8),
     (47, 14336, (200,), 16, 8), (33, 200, (40, -24, 40), 12, 3), (64, 3000, (64, 64), 64, 2)],
)  # fmt: skip
def test_kernels_equal_the_fp32_sum(rows, in_features, part_sizes, rank, max_loras):
    g = torch.Generator("cuda").manual_seed(rows * 1000 + rank)
    parts = sum(1 for n in part_sizes if n > 0)  # a negative size: a part of the layer no adapter targets
    out_features = sum(abs(n) for n in part_sizes)
    row_part, index = [], 0
    for n in part_sizes:
        row_part += [index if n > 0 else -1] * abs(n)
        index += n > 0
    row_part = torch.tensor(row_part, dtype=torch.int32, device="cuda")

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    x, y = rand(rows, in_features), rand(rows, out_features)
    a, b = rand(parts * max_loras * rank, in_features) / in_features**0.5, rand(out_features, max_loras, rank)
    adapters = torch.randint(0, max_loras + 1, (rows,), generator=g, device="cuda")
    adapters[0] = max_loras  # the last slot, and at least one row with none
    adapters[-1] = 0 if rows > 1 else adapters[-1]
    s = lora_kernels.lora_shrink(x, a, adapters, parts, max_loras)
    got = lora_kernels.lora_expand(y, s, b, row_part, adapters)
    want = reference(y, x, a, b, row_part, adapters, parts, max_loras)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    unadapted = adapters == 0
    assert torch.equal(got[unadapted], y[unadapted])  # rows naming slot 0: their output untouched
    assert not torch.equal(got[~unadapted], y[~unadapted])


@pytest.mark.parametrize("rows", [5, 37])
def test_the_kernel_form_agrees_with_the_matmul_form_on_a_real_layer(rows):
    torch.manual_seed(rows)
    layer = ColumnParallelLinear(256, [(0, 128), (0, 32), (0, 32)], False, TPGroup(), torch.bfloat16, "cuda")
    lin = LinearLora(layer, [("q_proj", 0), ("v_proj", 2)], max_loras=4, max_rank=16)
    lin.a.normal_(std=256**-0.5)
    lin.b.normal_()
    x = torch.randn(rows, 256, dtype=torch.bfloat16, device="cuda")
    adapters = torch.tensor([1, 0, 4, 2, 1] * (rows // 5) + [3] * (rows % 5), device="cuda")
    column_slot = torch.arange(1, 5, device="cuda").repeat_interleave(16)
    kernels = LoraBatch(adapters, column_slot, torch.bfloat16)
    matmul = LoraBatch(adapters, column_slot, torch.bfloat16)
    matmul.kernels = False
    assert kernels.kernels
    y = layer.weight.new_zeros(rows, 192)
    got, want = lin.add(y.clone(), x, kernels), lin.add(y.clone(), x, matmul)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)
    assert not got[:, 128:160].any()  # k: no adapter targets it
    assert not got[1].any()  # the row without an adapter
