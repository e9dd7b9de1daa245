"""The cost of online shadow verification and how fast it catches a wrong graph, on the GPU.

TPOT of decode-only batches with shadow verification at its default rate (one replayed step in 200
recomputed eagerly) against without, for each config and batch size, in one process (compare the
ratio). Then a fault is injected into one captured bucket's replay and the wall time until the
bucket is withdrawn is measured. Random weights of real shapes, max_model_len 2048, context 256.

    python bench/shadow_verify.py --configs 1b 8b --out bench/results/shadow_verify_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.decode_tpot import long_context_tpot, percentile, seeded_decode_batch
from policies.graph_policy import GraphPolicy
from workers.default_model import random_model
from workers.engine import EngineConfig, LLMEngine

CONTEXT = 256


def engine_for(model, every: int, buckets: tuple[int, ...]) -> LLMEngine:
    policy = GraphPolicy(decode_batch_buckets=buckets, shadow_verify_every_n_steps=every, compile=False)
    return LLMEngine(model, EngineConfig(max_num_seqs=max(buckets), max_model_len=model.max_model_len,
                                         graph_policy=policy))  # fmt: skip


def detection_latency_s(engine: LLMEngine, batch_size: int) -> dict:
    """Perturb the replay of the bucket serving batch_size and step until it is withdrawn."""
    bucket = engine.runner.table.dispatch(batch_size).bucket
    graph = engine.runner._replays[bucket]

    def perturbed() -> torch.Tensor:
        out = graph()
        out[:, :8] += 1.0
        return out

    seqs = seeded_decode_batch(engine, batch_size, CONTEXT, max_tokens=100_000)
    engine.runner._replays[bucket] = perturbed
    start, steps = time.perf_counter(), 0
    while bucket in engine.runner.table.ready:
        engine.step()
        steps += 1
    latency = time.perf_counter() - start
    for seq in seqs:
        engine.abort(seq.request_id)
    return dict(batch_size=batch_size, bucket=bucket, steps_to_detect=steps, seconds=latency)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["1b", "8b"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=1000, help="timed steps per measurement (5 checks at 1 in 200)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    buckets = tuple(sorted(set(args.batch_sizes)))
    rows, detection = [], []
    default_every = GraphPolicy().shadow_verify_every_n_steps
    for name in args.configs:
        model = random_model(name, 2048, "cuda")
        engines = {every: engine_for(model, every, buckets) for every in (0, default_every)}
        for bs in args.batch_sizes:
            for every, engine in engines.items():  # alternating, so drift of the machine hits both
                times = long_context_tpot(engine, bs, CONTEXT, args.steps, warmup=20)
                rows.append(dict(config=name, batch_size=bs, shadow_every_n_steps=every,
                                 tpot_ms_median=statistics.median(times), tpot_ms_mean=statistics.fmean(times),
                                 tpot_ms_p99=percentile(times, 0.99),
                                 checks=engine.runner.shadow.report()["checks"]))  # fmt: skip
                print(rows[-1], flush=True)
        for bs in args.batch_sizes:
            detection.append(dict(config=name, shadow_every_n_steps=default_every,
                                  **detection_latency_s(engines[default_every], bs)))  # fmt: skip
            print(detection[-1], flush=True)
        del engines, model
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, steps=args.steps, context=CONTEXT)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "detection": detection}, indent=1))
    print(markdown(rows, detection))


def markdown(rows: list[dict], detection: list[dict]) -> str:
    """Mean TPOT (the checks are rare spikes: the mean is what they cost) with and without."""
    lines = ["| config | bs | TPOT mean off (ms) | TPOT mean on (ms) | overhead |", "|---|---|---|---|---|"]
    keyed = {(r["config"], r["batch_size"], r["shadow_every_n_steps"] > 0): r for r in rows}
    for config, bs, on in sorted(keyed):
        if on:
            off_ms, on_ms = keyed[(config, bs, False)]["tpot_ms_mean"], keyed[(config, bs, True)]["tpot_ms_mean"]
            lines.append(f"| {config} | {bs} | {off_ms:.3f} | {on_ms:.3f} | {on_ms / off_ms - 1:+.1%} |")
    lines += ["", "| config | bs | steps to detect | seconds |", "|---|---|---|---|"]
    lines += [f"| {d['config']} | {d['batch_size']} | {d['steps_to_detect']} | {d['seconds']:.3f} |" for d in detection]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
