"""Chunked prefill: what long prompts cost the streams already running, and their own TTFT, per
step budget (`max_num_batched_tokens`).

A closed loop keeps `--streams` requests running on one engine (in-process, random weights of a
real shape, full CUDA graphs): each that finishes is replaced at once, and with `--long-every 4`
one new request in four brings a `--long-tokens` prompt (the others `--short-tokens`). Every
running short stream's inter-token latency (ITL: the time between the engine steps that gave it
consecutive tokens) is collected over `--steps` steps after a warm-up; long prompts' TTFT is from
their arrival to the step that gave their first token. Each budget also runs without long prompts
(`itl_ms_p99_no_long`). The largest budget (default 8192) holds a whole long prompt next to the
decodes: prefill as it was before chunking (`ttft_ms_long_p50_before`).

    python -m bench.chunked_prefill --config 1b --out bench/results/chunked_prefill_h200.json
    python -m bench.chunked_prefill --config tiny --device cpu --streams 8 --long-tokens 300 \\
        --short-tokens 20 --budgets 512 64 --steps 40 --out /tmp/chunked_prefill_cpu.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.prefix_cache import bench_model, free_device_memory, random_tokens
from bench.report import write_report
from policies.graph_policy import GraphPolicy
from workers.modeling.model import LlamaModel
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def closed_loop(model: LlamaModel, budget: int, args: argparse.Namespace, long_every: int | None) -> dict:
    config = EngineConfig(
        max_num_seqs=args.streams + 8,
        max_model_len=model.max_model_len,
        max_num_batched_tokens=budget,
        kv_cache_tokens=args.kv_cache_tokens,  # one engine at a time, and no preemption for pages
        graph_policy=GraphPolicy(compile=False, decode_batch_buckets=tuple(args.buckets)),
        enable_prefix_caching=False,
    )
    engine = LLMEngine(model, config)
    rng, vocab = random.Random(0), model.cfg.vocab_size
    arrivals = 0

    def arrive() -> None:
        nonlocal arrivals
        arrivals += 1
        long = long_every is not None and arrivals % long_every == 0
        tokens = random_tokens(rng, args.long_tokens if long else args.short_tokens, vocab)
        params = SamplingParams(max_tokens=args.long_output if long else args.short_output, ignore_eos=True)
        seq = engine.add_request(tokens, params)
        born[seq.request_id] = (time.perf_counter(), long)

    born: dict[str, tuple[float, bool]] = {}
    last: dict[str, float] = {}
    itl, ttft_long = [], []
    for _ in range(args.streams):
        arrive()
    for step in range(args.warmup + args.steps):
        events = engine.step()
        now = time.perf_counter()
        for e in events:
            arrived, long = born[e.request_id]
            if step >= args.warmup:
                if e.token_ids and e.request_id not in last and long:
                    ttft_long.append((now - arrived) * 1e3)
                if e.token_ids and e.request_id in last and not long:
                    itl.append((now - last[e.request_id]) * 1e3 / len(e.token_ids))
            if e.token_ids:
                last[e.request_id] = now
            if e.finish_reason is not None:
                last.pop(e.request_id, None)
                born.pop(e.request_id)
                arrive()
    tpot = statistics.median(itl) if itl else float("nan")
    result = {
        "itl_ms_p99": p(itl, 0.99),
        "itl_ms_p50": tpot,
        "ttft_ms_long_p50": p(ttft_long, 0.5),
        "long_prompts": len(ttft_long),
        "preemptions": engine.scheduler.num_preempted,
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1b", choices=["tiny", "1b", "8b"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--buckets", nargs="+", type=int, default=[1, 8, 32, 64, 128, 136])
    ap.add_argument("--short-tokens", type=int, default=136)
    ap.add_argument("--short-output", type=int, default=256)
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--long-output", type=int, default=256)
    ap.add_argument("--long-every", type=int, default=4)
    ap.add_argument("--budgets", nargs="+", type=int, default=[8192, 4096, 2048, 1024])
    ap.add_argument("--kv-cache-tokens", type=int, default=1 << 19)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = bench_model(args.config, args.max_model_len, args.device)
    rows = []
    for budget in args.budgets:
        mixed = closed_loop(model, budget, args, args.long_every)
        free_device_memory(args.device)  # each engine's pool is gone before the next one's is allocated
        plain = closed_loop(model, budget, args, None)
        free_device_memory(args.device)
        rows.append(
            {
                "config": args.config,
                "budget": budget,
                **mixed,
                "itl_ms_p99_no_long": plain["itl_ms_p99"],
                "tpot_ms_no_long": plain["itl_ms_p50"],
            }
        )
    before = rows[0]["ttft_ms_long_p50"]
    for row in rows:
        row["ttft_ms_long_p50_before"] = before
        row["itl_x_tpot"] = row["itl_ms_p99"] / row["tpot_ms_no_long"]
        row["ttft_x_before"] = row["ttft_ms_long_p50"] / before
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    meta = {"device": device, "torch": torch.__version__, **{k: v for k, v in vars(args).items() if k != "out"}}
    lines = [
        "| config | budget | ITL p99 ms | ITL p99 no long ms | TPOT no long ms | ITL p99 / TPOT (target <= 1.5) "
        "| long TTFT p50 ms | / before (target <= 1.2) | long prompts | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['budget']} | {r['itl_ms_p99']:.2f} | {r['itl_ms_p99_no_long']:.2f} "
            f"| {r['tpot_ms_no_long']:.2f} | {r['itl_x_tpot']:.2f} | {r['ttft_ms_long_p50']:.1f} "
            f"| {r['ttft_x_before']:.2f} | {r['long_prompts']} | {r['preemptions']} |"
        )
    note = (
        f"{args.streams} streams kept running ({args.short_tokens}-token prompts, {args.short_output} tokens); one new "
        f"request in {args.long_every} brings a {args.long_tokens}-token prompt. Budget {args.budgets[0]} holds a "
        "whole long prompt beside the decodes (as before chunked prefill).\n\n"
    )
    write_report(args.out, {"meta": meta, "rows": rows}, "\n".join(lines), note)


if __name__ == "__main__":
    main()
