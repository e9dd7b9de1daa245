"""One-off experiment (session 10): LoRA shrink and expand variants timed apart on the 8B layers, as
CUDA graph replays. The variant kernels here were tried and not kept; the numbers behind the choice are
in bench/results/lora_kernels.md.

    python -m bench.experiments.lora_kernel_variants --out bench/results/lora_kernel_variants_h200.json
"""

# ruff: noqa: B023, E731

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from bench.experiments.lora_kernel_combos import LAYERS, RANK, L, graph_us
from workers.modeling import lora_kernels as K


@triton.jit
def slot_expand_bf16(
    y_ptr,
    out_ptr,
    s_ptr,
    b_ptr,
    row_part_ptr,
    adapters_ptr,
    out_features,
    stride_y,
    rows,
    max_loras,
    num_splits,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    PARTS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    BLOCK_O: tl.constexpr,
    OUTER: tl.constexpr,
):
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
            split = tl.arange(0, SPLITS_PAD)
            if OUTER:
                rows_used = (split[:, None] < num_splits) & mine[None, :]
                for p in tl.static_range(PARTS):
                    here = part == p
                    if tl.max(here.to(tl.int32), axis=0) > 0:
                        for jj in tl.static_range(RANK):
                            sj = tl.sum(
                                tl.load(
                                    s_ptr + (split[:, None] * rows + r[None, :]) * (PARTS * RANK) + p * RANK + jj,
                                    mask=rows_used,
                                    other=0.0,
                                ),
                                axis=0,
                            )
                            bj = tl.load(
                                b_ptr + o * (max_loras * RANK) + (slot - 1).to(tl.int64) * RANK + jj,
                                mask=here,
                                other=0.0,
                            ).to(tl.float32)
                            result += sj[:, None] * bj[None, :]
            else:
                j = tl.arange(0, RANK_PAD)
                b = tl.load(
                    b_ptr + o[:, None] * (max_loras * RANK) + (slot - 1).to(tl.int64) * RANK + j[None, :],
                    mask=in_row[:, None] & (j[None, :] < RANK),
                    other=0.0,
                )
                partial = s_ptr + (split[:, None, None] * rows + r[None, :, None]) * (PARTS * RANK) + j[None, None, :]
                used = (split[:, None, None] < num_splits) & mine[None, :, None] & (j[None, None, :] < RANK)
                for p in tl.static_range(PARTS):
                    here = part == p
                    if tl.max(here.to(tl.int32), axis=0) > 0:
                        s = tl.sum(tl.load(partial + p * RANK, mask=used, other=0.0), axis=0)
                        result += tl.dot(s.to(b.dtype), tl.trans(tl.where(here[:, None], b, 0.0)))
        tl.store(out_ptr + at, result.to(y.dtype), mask=mine[:, None] & in_row[None, :])


@triton.jit
def row_expand_guard(
    y_ptr,
    out_ptr,
    s_ptr,
    b_ptr,
    row_part_ptr,
    adapters_ptr,
    out_features,
    stride_y,
    rows,
    max_loras,
    num_splits,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    PARTS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
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
        adapted = (part >= 0)[:, None] & (j < RANK)[None, :]
        b = tl.load(
            b_ptr + o[:, None] * (max_loras * RANK) + (slot - 1) * RANK + j[None, :], mask=adapted, other=0.0
        ).to(tl.float32)
        for p in tl.static_range(PARTS):
            here = part == p
            if tl.max(here.to(tl.int32), axis=0) > 0:
                sp = tl.sum(tl.load(partial + p * RANK, mask=used, other=0.0), axis=0)
                result += tl.sum(tl.where(here[:, None], b, 0.0) * sp[None, :], axis=1)
    tl.store(out_ptr + row * stride_y + o, result.to(y.dtype), mask=in_row)


def shrink(kind, x, a, adapters, parts):
    rows, inf = x.shape
    K.SLOT_GROUP_ROWS = 1 if kind == "slot" else 10**6
    return K.lora_shrink(x, a, adapters, parts, L)


def expand(kind, y, s, b, row_part, adapters):
    rows, outf = y.shape
    nsp, _, width = s.shape
    out = torch.empty_like(y)
    if kind == "row":
        K.SLOT_GROUP_ROWS = 10**6
        return K.lora_expand(y, s, b, row_part, adapters)
    if kind == "slot_ieee":
        K.SLOT_GROUP_ROWS = 1
        return K.lora_expand(y, s, b, row_part, adapters)
    if kind == "row_guard":
        row_expand_guard[(rows, triton.cdiv(outf, 128))](
            y,
            out,
            s,
            b,
            row_part,
            adapters,
            outf,
            y.stride(0),
            rows,
            L,
            nsp,
            RANK=RANK,
            RANK_PAD=16,
            PARTS=width // RANK,
            SPLITS_PAD=triton.next_power_of_2(nsp),
            BLOCK_O=128,
        )
        return out
    bo = 128
    slot_expand_bf16[(L + 1, triton.cdiv(outf, bo))](
        y,
        out,
        s,
        b,
        row_part,
        adapters,
        outf,
        y.stride(0),
        rows,
        L,
        nsp,
        RANK=RANK,
        RANK_PAD=16,
        PARTS=width // RANK,
        SPLITS_PAD=triton.next_power_of_2(nsp),
        ROWS_PAD=max(16, triton.next_power_of_2(rows)),
        BLOCK_O=bo,
        OUTER=kind == "slot_outer",
    )
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    rows_out = []
    for bs, distinct in [(1, 1), (8, 8), (16, 8), (32, 1), (32, 8)]:
        for name, (inf, parts) in LAYERS.items():
            outf = sum(parts)
            row_part = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(parts)]).cuda()
            a = torch.randn(len(parts) * L * RANK, inf, generator=g, device="cuda").bfloat16() / 64
            b = torch.randn(outf, L, RANK, generator=g, device="cuda").bfloat16()
            x = torch.randn(bs, inf, device="cuda").bfloat16()
            y = torch.randn(bs, outf, device="cuda").bfloat16()
            adapters = torch.tensor([i % distinct + 1 for i in range(bs)], device="cuda")
            rec = dict(bs=bs, distinct=distinct, layer=name)
            s_ref = {}
            for sk in ("row", "slot"):
                s_ref[sk] = shrink(sk, x, a, adapters, len(parts))
                rec[f"shrink_{sk}"] = graph_us(lambda sk=sk: shrink(sk, x, a, adapters, len(parts)))
            want = expand("row", y, s_ref["row"], b, row_part, adapters).float()
            for ek in ("row", "row_guard", "slot_ieee", "slot_bf16", "slot_outer"):
                s = s_ref["row" if ek.startswith("row") else "slot"]
                got = expand(ek, y, s, b, row_part, adapters).float()
                rec[f"err_{ek}"] = float((got - want).abs().max() / want.abs().max())
                rec[f"expand_{ek}"] = graph_us(lambda ek=ek, s=s: expand(ek, y, s, b, row_part, adapters))
            rows_out.append(rec)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
    json.dump(rows_out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
