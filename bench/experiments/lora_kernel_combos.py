"""One-off experiment (session 10): shrink + expand combinations timed as pairs on the 8B layers, as
CUDA graph replays, including split reductions finished by the last program (a counter per slot or row)
that were tried and not kept; the numbers behind the choice are in bench/results/lora_kernels.md.

    python -m bench.experiments.lora_kernel_combos --out bench/results/lora_kernel_combos_h200.json
"""

# ruff: noqa: B023, E731

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from workers.modeling import lora_kernels as K

LAYERS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
RANK, L, CALLS = 16, 8, 20


@triton.jit
def slot_shrink_sem(
    x_ptr,
    a_ptr,
    adapters_ptr,
    partial_ptr,
    out_ptr,
    count_ptr,
    in_features,
    stride_x,
    rows,
    max_loras,
    split_len,
    num_splits,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    PARTS: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
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
            x = tl.load(x_ptr + r[:, None] * stride_x + kk[None, :], mask=mine[:, None] & inside[None, :], other=0.0)
            a = tl.load(
                a_ptr + a_rows[:, None] * in_features + kk[None, :],
                mask=(j[:, None] < RANK) & inside[None, :],
                other=0.0,
            )
            acc = tl.dot(x, tl.trans(a), acc)
        cols = part * RANK + j
        keep = mine[:, None] & (j[None, :] < RANK)
        tl.store(partial_ptr + (split * rows + r[:, None]) * (PARTS * RANK) + cols[None, :], acc, mask=keep)
        counter = count_ptr + (slot - 1) * PARTS + part
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            sp = tl.arange(0, SPLITS_PAD)
            tot = tl.sum(
                tl.load(
                    partial_ptr + (sp[:, None, None] * rows + r[None, :, None]) * (PARTS * RANK) + cols[None, None, :],
                    mask=(sp < num_splits)[:, None, None] & keep[None, :, :],
                    other=0.0,
                    cache_modifier=".cg",
                ),
                axis=0,
            )
            tl.store(out_ptr + r[:, None] * (PARTS * RANK) + cols[None, :], tot, mask=keep)
            tl.atomic_xchg(counter, 0)


@triton.jit
def row_shrink_sem(
    x_ptr,
    a_ptr,
    adapters_ptr,
    partial_ptr,
    out_ptr,
    count_ptr,
    in_features,
    stride_x,
    rows,
    max_loras,
    split_len,
    num_splits,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
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
            a = tl.load(
                a_ptr + a_rows[:, None] * in_features + kk[None, :],
                mask=(j[:, None] < RANK) & inside[None, :],
                other=0.0,
            )
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
        cols = part * RANK + j
        tl.store(partial_ptr + (split * rows + row) * (PARTS * RANK) + cols, acc, mask=j < RANK)
        counter = count_ptr + row * PARTS + part
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            sp = tl.arange(0, SPLITS_PAD)
            tot = tl.sum(
                tl.load(
                    partial_ptr + (sp[:, None] * rows + row) * (PARTS * RANK) + cols[None, :],
                    mask=(sp[:, None] < num_splits) & (j[None, :] < RANK),
                    other=0.0,
                    cache_modifier=".cg",
                ),
                axis=0,
            )
            tl.store(out_ptr + row * (PARTS * RANK) + cols, tot, mask=j < RANK)
            tl.atomic_xchg(counter, 0)


COUNTS = {}


def shrink(kind, x, a, adapters, parts):
    rows, inf = x.shape
    if kind in ("row", "slot8", "slot1"):
        K.SLOT_GROUP_ROWS = 10**6 if kind == "row" else 1
        K.GROUP_SPLITS = 1 if kind == "slot1" else 8
        return K.lora_shrink(x, a, adapters, parts, L)
    by_slot = kind == "slot_sem"
    K.SLOT_GROUP_ROWS = 1 if by_slot else 10**6
    K.GROUP_SPLITS = 8
    n, split_len, block_k = K.shrink_shape(inf, RANK, rows)
    partial = torch.empty(n, rows, parts * RANK, dtype=torch.float32, device=x.device)
    out = torch.empty(1, rows, parts * RANK, dtype=torch.float32, device=x.device)
    key = (kind, parts)
    if key not in COUNTS:
        COUNTS[key] = torch.zeros(64 * parts, dtype=torch.int32, device=x.device)
    if by_slot:
        slot_shrink_sem[(L, parts, n)](
            x,
            a,
            adapters,
            partial,
            out,
            COUNTS[key],
            inf,
            x.stride(0),
            rows,
            L,
            split_len,
            n,
            RANK=RANK,
            RANK_PAD=16,
            PARTS=parts,
            ROWS_PAD=max(16, triton.next_power_of_2(rows)),
            BLOCK_K=block_k,
            SPLITS_PAD=triton.next_power_of_2(n),
        )
    else:
        row_shrink_sem[(rows, parts, n)](
            x,
            a,
            adapters,
            partial,
            out,
            COUNTS[key],
            inf,
            x.stride(0),
            rows,
            L,
            split_len,
            n,
            RANK=RANK,
            RANK_PAD=16,
            PARTS=parts,
            BLOCK_K=block_k,
            SPLITS_PAD=triton.next_power_of_2(n),
        )
    return out


def expand(kind, y, s, b, row_part, adapters):
    K.SLOT_GROUP_ROWS = 1 if kind == "slot" else 10**6
    return K.lora_expand(y, s, b, row_part, adapters)


def graph_us(fn):
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    ts = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / CALLS)
    return sorted(ts)[3]


COMBOS = [
    ("row", "row"),
    ("slot8", "slot"),
    ("slot1", "row"),
    ("slot1", "slot"),
    ("slot_sem", "row"),
    ("slot_sem", "slot"),
    ("row_sem", "row"),
    ("row_sem", "slot"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    recs = []
    totals = {}
    for bs, distinct in [(1, 1), (8, 8), (16, 8), (32, 1), (32, 4), (32, 8)]:
        for name, (inf, parts) in LAYERS.items():
            outf = sum(parts)
            row_part = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(parts)]).cuda()
            a = torch.randn(len(parts) * L * RANK, inf, generator=g, device="cuda").bfloat16() / 64
            b = torch.randn(outf, L, RANK, generator=g, device="cuda").bfloat16()
            x = torch.randn(bs, inf, device="cuda").bfloat16()
            y = torch.randn(bs, outf, device="cuda").bfloat16()
            adapters = torch.tensor([i % distinct + 1 for i in range(bs)], device="cuda")
            want = None
            rec = dict(bs=bs, distinct=distinct, layer=name)
            for sk, ek in COMBOS:
                pair = lambda sk=sk, ek=ek: expand(ek, y, shrink(sk, x, a, adapters, len(parts)), b, row_part, adapters)
                got = pair().float()
                for _ in range(3):
                    assert torch.equal(pair().float(), got), (sk, ek)  # repeatable (the counters reset)
                if want is None:
                    want = got
                key = f"{sk}+{ek}"
                rec["err_" + key] = float((got - want).abs().max() / want.abs().max())
                rec[key] = graph_us(pair)
                totals.setdefault((bs, distinct, key), 0.0)
                totals[(bs, distinct, key)] += rec[key] * 32 / 1e3
            recs.append(rec)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
    for (bs, distinct, key), ms in totals.items():
        print("step_ms", bs, distinct, key, round(ms, 3))
    json.dump(
        {"rows": recs, "step_ms": [dict(bs=b, distinct=d, combo=k, ms=v) for (b, d, k), v in totals.items()]},
        open(args.out, "w"),
        indent=1,
    )


if __name__ == "__main__":
    main()
