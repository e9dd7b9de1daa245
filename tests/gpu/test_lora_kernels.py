"""The LoRA expand kernel (`lora_kernels.py`) against the same sum in fp32 torch, on fresh random
slots: odd row counts on both sides of `SLOT_GROUP_ROWS` (programs per row, programs per slot), rows
without an adapter, fused layers with an untargeted part, ranks that are not powers of two, y and s
as column slices of one GEMM's output; and LinearLora's two forms agree on a real layer."""

from __future__ import annotations

import pytest
import torch

from workers.modeling import lora_kernels
from workers.modeling.lora import LinearLora, LoraBatch
from workers.modeling.parallel import ColumnParallelLinear, TPGroup

pytestmark = pytest.mark.gpu


def reference(y, s, b, row_part, adapters, max_loras):
    """y + B[slot] s[part, slot] for each row and output feature, in fp32."""
    rank = b.shape[2]
    out = y.float().clone()
    for r, slot in enumerate(adapters.tolist()):
        if slot == 0:
            continue
        for o in range(y.shape[1]):
            p = int(row_part[o])
            if p >= 0:
                start = (p * max_loras + slot - 1) * rank
                out[r, o] += b[o, slot - 1].float() @ s[r, start : start + rank].float()
    return out


@pytest.mark.parametrize(
    ("rows", "part_sizes", "rank", "max_loras"),
    [(1, (48, 16, 16), 16, 8), (3, (40, -24, 40), 12, 3), (7, (64, 64), 64, 2), (32, (96,), 8, 4),
     (64, (16, 16, 16), 4, 5), (15, (48, -16, 80), 16, 8), (47, (200,), 16, 8), (33, (40, -24, 40), 12, 3),
     (64, (300, 64), 64, 2)],
)  # fmt: skip
def test_expand_equals_the_fp32_sum(rows, part_sizes, rank, max_loras):
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

    z = rand(rows, out_features + parts * max_loras * rank)  # as the layer's GEMM leaves them: side by side
    y, s = z[:, :out_features], z[:, out_features:]
    b = rand(out_features, max_loras, rank)
    adapters = torch.randint(0, max_loras + 1, (rows,), generator=g, device="cuda")
    adapters[0] = max_loras  # the last slot, and at least one row with none
    adapters[-1] = 0 if rows > 1 else adapters[-1]
    got = lora_kernels.lora_expand(y, s, b, row_part, adapters)
    want = reference(y, s, b, row_part, adapters, max_loras)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=5e-2)
    unadapted = adapters == 0
    assert torch.equal(got[unadapted], y[unadapted])  # rows naming slot 0: their output untouched
    assert not torch.equal(got[~unadapted], y[~unadapted])


@pytest.mark.parametrize("rows", [5, 37])
def test_the_kernel_form_agrees_with_the_matmul_form_on_a_real_layer(rows):
    torch.manual_seed(rows)
    layer = ColumnParallelLinear(256, [(0, 128), (0, 32), (0, 32)], True, TPGroup(), torch.bfloat16, "cuda")
    layer.weight.normal_(std=256**-0.5)
    layer.bias.normal_()
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
    got, want = lin.forward(x, kernels, bias=True), lin.forward(x, matmul, bias=True)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)[:, :192]  # the GEMM's own output columns
    assert torch.equal(got[:, 128:160], plain[:, 128:160])  # k: no adapter targets it
    assert torch.equal(got[1], plain[1])  # the row without an adapter
    assert not torch.equal(got[0], plain[0])
