"""The cost of online shadow verification and how fast it catches a wrong graph, on the GPU.

TPOT of decode-only batches with shadow verification at its default rate against without, for
each config and batch size, on one engine taking turns (compare the ratio); and with every replay
checked, which prices one check (the mean step time it adds), so the overhead of any other rate
follows: check cost / (n x TPOT). Then a fault is injected into one
captured bucket's replay and the wall time until the bucket is withdrawn is measured. Random
weights of real shapes, max_model_len 2048, context 256, plain graphs (compile off: the eager
recomputation is the costly one).

    python -m bench.shadow_verify --configs 1b 8b --out bench/results/shadow_verify_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.decode_tpot import long_context_tpot, percentile, seeded_decode_batch
from bench.report import write_report
from policies.graph_policy import GraphPolicy
from workers.modeling.synthetic import random_model
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig

CONTEXT = 256


def engine_for(model, buckets: tuple[int, ...]) -> LLMEngine:
    policy = GraphPolicy(decode_batch_buckets=buckets, compile=False)
    return LLMEngine(
        model, EngineConfig(max_num_seqs=max(buckets), max_model_len=model.max_model_len, graph_policy=policy)
    )


def interleaved_tpot(engine: LLMEngine, batch_size: int, rates: dict[int, int], rounds: int) -> dict[int, list[float]]:
    """Step times (ms) at each checking rate (every n-th replay; 0: none), `rates[n]` steps at a
    time, taking turns for `rounds` rounds on one engine: the same graphs and memory for every
    rate, and the machine's drift spread over all. Each turn starts a fresh batch at CONTEXT."""
    times: dict[int, list[float]] = {every: [] for every in rates}
    for _ in range(rounds):
        for every, steps in rates.items():
            engine.runner.shadow.every_n = every
            times[every] += long_context_tpot(engine, batch_size, CONTEXT, steps, warmup=5)
    engine.runner.shadow.every_n = GraphPolicy().shadow_verify_every_n_steps
    return times


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
    ap.add_argument("--steps", type=int, default=300, help="steps per turn without checks and at each rate")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rates", nargs="+", type=int, default=[500, 1000], help="check every n-th replay (besides 0, 1)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    buckets = tuple(sorted(set(args.batch_sizes)))
    rows, detection = [], []
    default_every = GraphPolicy().shadow_verify_every_n_steps
    rates = {0: args.steps, **dict.fromkeys(args.rates, args.steps), 1: args.steps // 10}  # 1: fewer, they are slow
    for name in args.configs:
        model = random_model(name, 2048, "cuda")
        engine = engine_for(model, buckets)
        for bs in args.batch_sizes:
            for every, times in interleaved_tpot(engine, bs, rates, args.rounds).items():
                rows.append(
                    dict(
                        config=name,
                        batch_size=bs,
                        shadow_every_n_steps=every,
                        steps=len(times),
                        tpot_ms_median=statistics.median(times),
                        tpot_ms_mean=statistics.fmean(times),
                        tpot_ms_p99=percentile(times, 0.99),
                    )
                )
                print(rows[-1], flush=True)
        for bs in args.batch_sizes:
            detection.append(dict(config=name, shadow_every_n_steps=default_every, **detection_latency_s(engine, bs)))
            print(detection[-1], flush=True)
        del engine, model
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, context=CONTEXT, rounds=args.rounds)
    write_report(args.out, {"meta": meta, "rows": rows, "detection": detection}, markdown(rows, detection))


def markdown(rows: list[dict], detection: list[dict]) -> str:
    """Mean TPOT (the checks are rare spikes: the mean is what they cost) without checks, at the
    default rate and with every replay checked; the last prices one check and predicts the rate's
    overhead."""
    lines = [
        "| config | bs | TPOT off (ms) | TPOT at 1/n (ms) | overhead | one check (ms) | predicted at 1/n |",
        "|---|---|---|---|---|---|---|",
    ]
    keyed = {(r["config"], r["batch_size"], r["shadow_every_n_steps"]): r["tpot_ms_mean"] for r in rows}
    rates = sorted({every for _, _, every in keyed} - {0, 1})
    for config, bs, every in sorted(k for k in keyed if k[2] in rates):
        off, on, all_checked = keyed[(config, bs, 0)], keyed[(config, bs, every)], keyed[(config, bs, 1)]
        check = all_checked - off
        lines.append(
            f"| {config} | {bs} | {off:.3f} | {on:.3f} (n={every}) | {on / off - 1:+.1%} | {check:.3f} "
            f"| {check / (every * off):+.1%} |"
        )
    lines += ["", "| config | bs | steps to detect | seconds |", "|---|---|---|---|"]
    lines += [f"| {d['config']} | {d['batch_size']} | {d['steps_to_detect']} | {d['seconds']:.3f} |" for d in detection]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
