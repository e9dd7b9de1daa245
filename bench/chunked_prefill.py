"""Chunked prefill: what long prompts cost the streams already running, and their own TTFT, per
step budget (`max_num_batched_tokens`) and pacing threshold (`long_prefill_token_threshold`).

A closed loop keeps `--streams` requests running on one engine (in-process, random weights of a
real shape, full CUDA graphs): each that finishes is replaced at once, and with `--long-every 4`
one new request in four brings a `--long-tokens` prompt (the others `--short-tokens`). Every
running short stream's inter-token latency (ITL: the time between the engine steps that gave it
consecutive tokens) is collected over `--steps` steps after a warm-up; long prompts' TTFT is from
their arrival to the step that gave their first token. Every budget runs with every threshold of
`--long-prefill-thresholds` (0: unpaced), a row each, and also without long prompts
(`itl_ms_p99_no_long`; a threshold no short prompt reaches cuts nothing there, so that run is the
unpaced one). The first budget (default 8192) unpaced holds a whole long prompt next to the
decodes: prefill as it was before chunking (`ttft_ms_long_p50_before`). With equal output lengths the
streams started together end together, so the loop replaces them in waves of prompts;
`--staggered-outputs` draws each output length around the same mean instead.

    python -m bench.chunked_prefill --config 1b --out bench/results/chunked_prefill_h200.json
    python -m bench.chunked_prefill --config tiny --device cpu --streams 8 --long-tokens 300 \\
        --short-tokens 20 --budgets 512 64 --long-prefill-thresholds 0 128 --steps 40 \\
        --out /tmp/chunked_prefill_cpu.json
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


def closed_loop(
    model: LlamaModel, budget: int, threshold: int, args: argparse.Namespace, long_every: int | None
) -> dict:
    config = EngineConfig(
        max_num_seqs=args.streams + 8,
        max_model_len=model.max_model_len,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
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
        output = args.long_output if long else args.short_output
        if args.staggered_outputs:  # same mean, but streams started together do not end together
            output = rng.randint(output // 2, output * 3 // 2)
        params = SamplingParams(max_tokens=output, ignore_eos=True)
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


def mean_request(args: argparse.Namespace) -> tuple[float, float]:
    """A new request's mean prompt and output tokens. A stream starts a new request when its last
    one ends, so requests arrive at streams / mean output a step (fewer while prompts wait for
    their prefill) and bring streams x mean prompt / mean output prompt tokens a step: a budget
    must hold these and one token per running stream, or prompts queue and their TTFT grows
    without bound, whatever the pacing."""
    mean_prompt = ((args.long_every - 1) * args.short_tokens + args.long_tokens) / args.long_every
    mean_output = ((args.long_every - 1) * args.short_output + args.long_output) / args.long_every
    return mean_prompt, mean_output


def measure(model: LlamaModel, args: argparse.Namespace) -> list[dict]:
    """A row per (budget, threshold): the mixed workload's ITL and long TTFT, beside the ITL of
    the same budget without long prompts."""
    rows, plain_runs = [], {}
    for budget in args.budgets:
        for threshold in args.long_prefill_thresholds:
            mixed = closed_loop(model, budget, threshold, args, args.long_every)
            free_device_memory(args.device)  # each engine's pool is gone before the next one's is allocated
            plain_threshold = threshold if threshold < args.short_tokens else 0  # cutting no prompt: unpaced
            if (budget, plain_threshold) not in plain_runs:
                plain_runs[budget, plain_threshold] = closed_loop(model, budget, plain_threshold, args, None)
                free_device_memory(args.device)
            plain = plain_runs[budget, plain_threshold]
            rows.append(
                {
                    "config": args.config,
                    "budget": budget,
                    "long_prefill_token_threshold": threshold,
                    **mixed,
                    "itl_ms_p99_no_long": plain["itl_ms_p99"],
                    "tpot_ms_no_long": plain["itl_ms_p50"],
                }
            )
    before = next(r for r in rows if r["budget"] == args.budgets[0] and r["long_prefill_token_threshold"] == 0)
    for row in rows:
        row["ttft_ms_long_p50_before"] = before["ttft_ms_long_p50"]
        row["itl_x_tpot"] = row["itl_ms_p99"] / row["tpot_ms_no_long"]
        row["ttft_x_before"] = row["ttft_ms_long_p50"] / before["ttft_ms_long_p50"]
    return rows


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
    ap.add_argument(
        "--staggered-outputs",
        action="store_true",
        help="each request's output length drawn uniformly from 0.5x to 1.5x its --*-output (same mean), so the "
        "streams the loop starts together are not replaced together in waves",
    )
    ap.add_argument("--budgets", nargs="+", type=int, default=[8192, 4096, 2048, 1024])
    ap.add_argument("--long-prefill-thresholds", nargs="+", type=int, default=[0])
    ap.add_argument("--kv-cache-tokens", type=int, default=1 << 19)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if 0 not in args.long_prefill_thresholds:
        ap.error("--long-prefill-thresholds must include 0: the first budget unpaced is the `before` of every row")
    torch.manual_seed(0)
    model = bench_model(args.config, args.max_model_len, args.device)
    rows = measure(model, args)
    mean_prompt, mean_output = mean_request(args)
    per_step = args.streams * mean_prompt / mean_output
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    meta = {
        "device": device,
        "torch": torch.__version__,
        **{k: v for k, v in vars(args).items() if k != "out"},
        "prompt_tokens_per_step": per_step,
    }
    lines = [
        "| config | budget | threshold | ITL p99 ms | ITL p99 no long ms | TPOT no long ms "
        "| ITL p99 / TPOT (target <= 1.5) | long TTFT p50 ms | / before (target <= 1.2) | long prompts | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['budget']} | {r['long_prefill_token_threshold']} | {r['itl_ms_p99']:.2f} "
            f"| {r['itl_ms_p99_no_long']:.2f} "
            f"| {r['tpot_ms_no_long']:.2f} | {r['itl_x_tpot']:.2f} | {r['ttft_ms_long_p50']:.1f} "
            f"| {r['ttft_x_before']:.2f} | {r['long_prompts']} | {r['preemptions']} |"
        )
    note = (
        f"{args.streams} streams kept running ({args.short_tokens}-token prompts, {args.short_output} tokens"
        f"{', each output length drawn from 0.5x to 1.5x of it' if args.staggered_outputs else ''}); one new "
        f"request in {args.long_every} brings a {args.long_tokens}-token prompt. Budget {args.budgets[0]} holds a "
        "whole long prompt beside the decodes (as before chunked prefill); threshold: `long_prefill_token_threshold` "
        "(0: unpaced).\n\n"
        f"The workload brings {per_step:.0f} prompt tokens a step on average ({args.streams} streams x "
        f"{mean_prompt:.0f}-token mean prompt / {mean_output:.0f}-token mean output): a budget under "
        f"{per_step + args.streams:.0f} (those and one token per running stream) cannot keep up, and long prompts "
        "queue.\n\n"
    )
    write_report(args.out, {"meta": meta, "rows": rows}, "\n".join(lines), note)


if __name__ == "__main__":
    main()
