"""Non-streamed `max_tokens: 1` requests against the engine alone: how many a second one engine
finishes and the host CPU it spends on each, the bound issue 29's unary knee meets (the served knee
sits where the engine child's core is full).

A closed loop in-process: `--concurrency` requests outstanding, each a new one as soon as one ends,
all with the same ~130-token prompt of `bench/serve_load.py`'s unary level (after the first, its full
pages come from the prefix cache, as they do there). The app's GPU settings: max_model_len 8192,
buckets 1..256, compiled graphs. A timed round, then the same round under cProfile, whose table of
functions (own time, cumulative time), beside the JSON as `<name>_profile.txt`, says where a
request's host time goes.

    python -m bench.unary_engine --config 1b --out bench/results/unary_engine_h100.json
    python -m bench.unary_engine --config tiny --device cpu --seconds 2 --out /tmp/unary_engine_cpu.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch

from bench.report import write_report
from bench.serve_load import PROMPTS
from policies.graph_policy import GraphPolicy
from workers.modeling.synthetic import BENCH_CONFIGS, build_byte_tokenizer, tiny_hf_config, write_checkpoint
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams


def closed_loop(engine: LLMEngine, prompt: list[int], concurrency: int, seconds: float) -> dict:
    """`concurrency` requests outstanding for `seconds`: finished requests a second, host CPU ms and
    engine steps per request."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    finished = 0

    def count(events: list) -> None:
        nonlocal finished
        finished += sum(1 for e in events if e.finish_reason is not None)

    for _ in range(concurrency):
        engine.add_request(prompt, params)
    steps, cpu0, t0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        before = finished
        count(engine.step(count))
        steps += 1
        for _ in range(finished - before):
            engine.add_request(prompt, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    while engine.has_work():
        engine.step()
    return {
        "concurrency": concurrency,
        "requests_per_s": finished / wall,
        "cpu_ms_per_request": cpu * 1e3 / finished,
        "cpu_share": cpu / wall,
        "steps_per_request": steps / finished,
        "requests": finished,
    }


def profiled(engine: LLMEngine, prompt: list[int], concurrency: int, seconds: float, top: int) -> str:
    profile = cProfile.Profile()
    profile.enable()
    row = closed_loop(engine, prompt, concurrency, seconds)
    profile.disable()
    out = io.StringIO()
    rate, cpu = row["requests_per_s"], row["cpu_ms_per_request"]
    print(f"under cProfile: {rate:.0f} req/s, {cpu:.3f} ms CPU/request", file=out)
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1b", choices=["1b", "8b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--buckets", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--kv-cache-tokens", type=int, default=1 << 19)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--top", type=int, default=45, help="functions in each profile table")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp())
    model_dir = work / f"llama-{args.config}-random"
    tokenizer = build_byte_tokenizer()
    shape = tiny_hf_config(len(tokenizer)) if args.config == "tiny" else BENCH_CONFIGS[args.config]
    write_checkpoint(model_dir, shape, tokenizer, seed=0)
    gpu = args.device == "cuda"
    policy = GraphPolicy(decode_batch_buckets=args.buckets, compile=not args.no_compile and gpu)
    engine, tok = LLMEngine.from_config(
        EngineConfig(
            model=str(model_dir),
            device=args.device,
            graph_policy=policy,
            max_model_len=args.max_model_len,
            max_num_seqs=max(args.buckets),
            kv_cache_tokens=args.kv_cache_tokens,
            compile_cache_dir=str(work / "inductor"),
        )
    )
    prompt = tok(PROMPTS["short"])["input_ids"]
    rows = []
    for c in args.concurrency:
        closed_loop(engine, prompt, c, min(2.0, args.seconds))  # warm-up at this level
        rows.append(closed_loop(engine, prompt, c, args.seconds))
        print(rows[-1], flush=True)
    profile = profiled(engine, prompt, args.concurrency[0], args.seconds, args.top)
    out = Path(args.out)
    out.with_name(f"{out.stem}_profile.txt").write_text(profile)
    meta = {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "config": args.config,
        "prompt_tokens": len(prompt),
        "compile": policy.compile,
        "buckets": args.buckets,
    }
    lines = [
        "| concurrent | req/s | CPU ms per request | CPU share | steps per request |",
        "|---|---|---|---|---|",
        *(
            f"| {r['concurrency']} | {r['requests_per_s']:,.0f} | {r['cpu_ms_per_request']:.3f} | "
            f"{r['cpu_share']:.2f} | {r['steps_per_request']:.3f} |"
            for r in rows
        ),
    ]
    write_report(args.out, {"meta": meta, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
