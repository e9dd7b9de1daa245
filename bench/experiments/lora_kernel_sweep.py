"""Time the LoRA decode kernels alone, on the 8B shape's four adapted layers, as CUDA graph replays.

For each layer (qkv, o, gate_up, down), batch size and number of distinct adapters, a graph of 20
shrink + expand pairs is replayed and timed; the per-pair time is summed over the four layers and
multiplied by 32 layers: what the kernels add to one decode step. Variants set the kernels' block
constants, so a choice among them rests on a measurement. A pair of y.clone() calls is the floor.

    python -m bench.experiments.lora_kernel_sweep --out bench/results/lora_kernel_sweep_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from workers.modeling import lora_kernels as K

LAYERS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}  # fmt: skip
RANK, MAX_LORAS, NUM_LAYERS, PAIRS = 16, 8, 32, 20


def layer_tensors(in_features: int, parts: tuple[int, ...], g: torch.Generator) -> dict:
    out = sum(parts)
    row_part = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(parts)]).cuda()
    a = torch.randn(len(parts) * MAX_LORAS * RANK, in_features, generator=g, device="cuda").bfloat16() / 64
    b = torch.randn(out, MAX_LORAS, RANK, generator=g, device="cuda").bfloat16()
    return dict(a=a, b=b, row_part=row_part, parts=len(parts), out=out, in_features=in_features)


def pair_us(t: dict, rows: int, distinct: int, floor: bool) -> float:
    x = torch.randn(rows, t["in_features"], device="cuda").bfloat16()
    y = torch.randn(rows, t["out"], device="cuda").bfloat16()
    adapters = torch.tensor([i % distinct + 1 if distinct else 0 for i in range(rows)], device="cuda")

    def pair():
        if floor:
            return y.clone(), x.clone()
        s = K.lora_shrink(x, t["a"], adapters, t["parts"], MAX_LORAS)
        return K.lora_expand(y, s, t["b"], t["row_part"], adapters)

    for _ in range(3):
        pair()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(PAIRS):
            pair()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / PAIRS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 16, 32])
    args = ap.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    tensors = {name: layer_tensors(i, p, g) for name, (i, p) in LAYERS.items()}
    variants = [("floor", {})]
    variants += [("per_row", {"SLOT_GROUP_ROWS": 10**6})]
    variants += [(f"slot_splits{s}_tile{t}_o{o}", dict(SLOT_GROUP_ROWS=1, GROUP_SPLITS=s, GROUP_TILE=t, BLOCK_O=o))
                 for s, t, o in itertools.product((4, 8, 16), (4096, 8192), (64, 128))]  # fmt: skip
    defaults = {k: getattr(K, k) for k in ("SLOT_GROUP_ROWS", "GROUP_SPLITS", "GROUP_TILE", "BLOCK_O")}
    rows = []
    for (name, settings), bs, distinct in itertools.product(variants, args.batch_sizes, (0, 1, 8)):
        if distinct > bs:
            continue
        for k, v in {**defaults, **settings}.items():
            setattr(K, k, v)
        per_layer = {n: pair_us(t, bs, distinct, name == "floor") for n, t in tensors.items()}
        step_ms = sum(per_layer.values()) * NUM_LAYERS / 1e3
        rows.append(dict(variant=name, batch_size=bs, adapters=distinct, per_layer_us=per_layer, step_ms=step_ms))
        print(name, bs, distinct, round(step_ms, 3), {k: round(v, 1) for k, v in per_layer.items()}, flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
              open(args.out, "w"), indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
