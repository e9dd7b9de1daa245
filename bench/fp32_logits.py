"""What fp32 final logits cost: the LM head as one GEMM writing bf16 against one writing fp32
(`model.fp32_linear`), each captured in a CUDA graph and replayed, at the 8B shape (4096 -> 128256)
and SmolLM2's (576 -> 49152). Compare the two as ratios within this run.

    python -m bench.fp32_logits --out bench/results/fp32_logits_h200.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.report import write_report
from workers.modeling.model import fp32_linear

SHAPES = {"8b": (4096, 128256), "smollm2": (576, 49152)}


def replay_ms(fn, x: torch.Tensor, weight: torch.Tensor, replays: int) -> float:
    """Median time of one replay of `fn(x, weight)` captured in a CUDA graph."""
    for _ in range(3):
        fn(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x, weight)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for name, (hidden, vocab) in SHAPES.items():
        weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
        for bs in args.batch_sizes:
            x = torch.randn(bs, hidden, device="cuda", dtype=torch.bfloat16)
            bf16 = replay_ms(F.linear, x, weight, args.replays)
            fp32 = replay_ms(fp32_linear, x, weight, args.replays)
            rows.append(dict(shape=name, batch_size=bs, bf16_ms=bf16, fp32_ms=fp32, ratio=fp32 / bf16))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, replays=args.replays)
    lines = ["| shape | bs | bf16 logits | fp32 logits | ratio |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['shape']} | {r['batch_size']} | {r['bf16_ms'] * 1e3:.1f} us | {r['fp32_ms'] * 1e3:.1f} us | "
        f"{r['ratio']:.3f}x |"
        for r in rows
    ]
    write_report(args.out, {"meta": meta, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
