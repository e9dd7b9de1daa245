"""What a client gets against what the engine makes, in one run: the engine alone (in-process, the
same config) and the Serve app through the real `openai` client, at fixed concurrency levels and
at Poisson arrival rates, with short and long prompts. Metrics are named as `vllm bench serve`
names them: TTFT, TPOT, ITL and E2E latency (mean, median, p99, in ms), request throughput and
output token throughput. ITL is the gap between two streamed chunks (a chunk may carry several
tokens: the replica coalesces a stream's tokens).

With --profile-streams N, py-spy samples the ingress, the LLM replica, the engine child and Serve's
proxy while the served level of N streams (short prompts) runs; their collapsed stacks and a summary
of where each process spends its samples land beside the JSON.

    python bench/serve_load.py --config 1b --out bench/results/serve_load_h200.json
    python bench/serve_load.py --config tiny --device cpu --streams 64 --prompts short --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import torch

from bench.report import write_report

TEXT = "The quick brown fox jumps over the lazy dog, and the dog, who had seen it all, sighed. " * 20
PROMPTS = {"short": TEXT[:130], "long": TEXT[:1500]}  # the byte tokenizer: a token per byte (plus BOS)
IDLE_BEFORE_ROUND_S = 2.0
ADMIN = "bench-admin"
PROCESS_TITLES = {"ingress": "Ingress", "replica": "LLMReplica", "proxy": "ProxyActor"}


def printable_outputs(model_dir: Path) -> None:
    """Random weights choose tokens the byte tokenizer decodes to nothing (ids past the bytes), and
    empty text sends no SSE event, which would hide the streaming cost a real model pays. Zeroing
    every output row but printable ASCII's makes each token a visible character."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state = load_file(path)
    head = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
    keep = torch.zeros(state[head].shape[0], dtype=torch.bool)
    keep[32:127] = True
    state[head][~keep] = 0
    save_file(state, path, metadata={"format": "pt"})


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def arrivals(streams: int, rate: float | None, seed: int = 0) -> list[float]:
    """Offsets (s) at which requests arrive: all at once for a concurrency level, else Poisson."""
    if rate is None:
        return [0.0] * streams
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(streams):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def summary(per_request: list[dict], wall_s: float) -> dict:
    """vllm bench serve's metrics from per-request times (seconds): ttft, tpot, itl (list), e2e, tokens."""
    tokens = sum(r["tokens"] for r in per_request)
    ms = lambda key: [r[key] * 1e3 for r in per_request if r.get(key) is not None]  # noqa: E731
    return {
        "requests": len(per_request),
        "output_tokens": tokens,
        "duration_s": wall_s,
        "request_throughput": len(per_request) / wall_s,
        "output_token_throughput": tokens / wall_s,
        "ttft_ms": percentiles(ms("ttft")),
        "tpot_ms": percentiles(ms("tpot")),
        "itl_ms": percentiles([g * 1e3 for r in per_request for g in r.get("itl", [])]),
        "e2e_latency_ms": percentiles(ms("e2e")),
    }


def engine_level(engine, prompt_ids: list[int], offsets: list[float], max_tokens: int) -> dict:
    """The engine alone under the same arrivals: requests are added when they arrive, between steps."""
    from workers.serving.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    time.sleep(IDLE_BEFORE_ROUND_S)
    pending, seqs, arrived = list(offsets), [], []
    t0 = time.monotonic()
    while pending or engine.has_work():
        now = time.monotonic() - t0
        while pending and pending[0] <= now:
            pending.pop(0)
            arrived.append(t0 + now)
            seqs.append(engine.add_request(prompt_ids, params))
        if engine.has_work():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0] - (time.monotonic() - t0)))
    wall = time.monotonic() - t0
    rows = []
    for seq, at in zip(seqs, arrived):
        n = len(seq.output_ids)
        tpot = (seq.last_token_time - seq.first_token_time) / (n - 1) if n > 1 else None
        rows.append({"ttft": seq.first_token_time - at, "tpot": tpot, "e2e": seq.last_token_time - at, "tokens": n})
    return summary(rows, wall)


async def one_stream(client, model: str, prompt: str, max_tokens: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    chunks, tokens = [], 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices:
            chunks.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first, last = chunks[0], chunks[-1]
    return {
        "ttft": first - start,
        "tpot": (last - first) / (tokens - 1) if tokens > 1 else None,
        "itl": [b - a for a, b in zip(chunks, chunks[1:])],
        "e2e": end - start,
        "tokens": tokens,
        "chunks": len(chunks),
    }


async def served_level(
    base_url: str, model: str, prompt: str, offsets: list[float], max_tokens: int, on_start=lambda: None
) -> dict:
    """The same arrivals through the app, from one client whose connections are open (a warm-up
    first); on_start() runs as the measured round starts."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    await asyncio.gather(*[one_stream(client, model, prompt, 4, 0.0) for _ in range(min(len(offsets), 64))])
    await asyncio.sleep(IDLE_BEFORE_ROUND_S)
    on_start()
    t0 = time.perf_counter()
    rows = await asyncio.gather(*[one_stream(client, model, prompt, max_tokens, d) for d in offsets])
    result = summary(list(rows), time.perf_counter() - t0)
    result["chunks_per_request"] = statistics.median(r["chunks"] for r in rows)
    await client.close()
    return result


async def unary_knee(base_url: str, model: str, levels: list[int], per_level: int) -> list[dict]:
    """Non-streamed requests with max_tokens 1 from c concurrent workers: requests/s per level."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    out = []
    for c in levels:
        done = 0

        async def worker() -> None:
            nonlocal done
            while done < per_level:
                done += 1
                await client.completions.create(model=model, prompt=PROMPTS["short"], max_tokens=1, temperature=0.0)

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(c)])
        out.append({"concurrency": c, "requests_per_s": done / (time.perf_counter() - t0)})
        print("unary", out[-1], flush=True)
    await client.close()
    return out


def serve_pids() -> dict[str, int]:
    """The ingress, LLM replica, engine child and proxy processes of the running app."""
    import psutil

    pids = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "workers.front.engine_process" in cmd:
            pids["engine"] = p.info["pid"]
        for role, title in PROCESS_TITLES.items():
            if cmd.startswith("ray::") and title in cmd.split(" ")[0]:
                pids[role] = p.info["pid"]
    return pids


def profile(out_dir: Path, seconds: float) -> list[subprocess.Popen]:
    """py-spy record of each serving process for `seconds` (collapsed stacks, idle frames left out)."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        print("py-spy not found: no profile", flush=True)
        return []
    return [
        subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(int(seconds)),
                "--rate",
                "200",
                "--format",
                "raw",
                "--nonblocking",
                "--output",
                str(out_dir / f"profile_{role}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for role, pid in serve_pids().items()
    ]


def profile_summary(out_dir: Path, top: int = 25) -> dict:
    """Per process: its samples, and the functions holding the most of them (inclusive), by share."""
    result = {}
    for path in sorted(out_dir.glob("profile_*.txt")):
        inclusive: Counter[str] = Counter()
        total = 0
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            for frame in set(stack.split(";")):
                inclusive[frame.split(" (")[0] + " " + frame.rsplit("/", 1)[-1].split(":")[0]] += n
        result[path.stem.removeprefix("profile_")] = {
            "samples": total,
            "top": [(f, round(n / max(total, 1), 3)) for f, n in inclusive.most_common(top)],
        }
    return result


def cpu_sampler(stop: threading.Event, samples: list[dict]) -> None:
    """Each serving process's CPU use once a second (percent of one core)."""
    import psutil

    procs = {role: psutil.Process(pid) for role, pid in serve_pids().items()}
    for p in procs.values():
        p.cpu_percent()
    while not stop.wait(1.0):
        samples.append({role: p.cpu_percent() for role, p in procs.items()})


def table(rows: list[dict]) -> str:
    head = (
        "| shape | prompt | streams / rate | engine tok/s | served tok/s | ratio | TPOT engine / served ms | "
        "TPOT ratio | TTFT p50 / p99 ms | ITL p99 ms | chunks per request |\n|" + "---|" * 11
    )
    lines = [head]
    for r in rows:
        level = f"{r['request_rate']:g} req/s" if r.get("request_rate") else str(r["streams"])
        lines.append(
            f"| {r['model_shape']} | {r['prompt']} | {level} | {r['engine_tok_s']:,.0f} | "
            f"{r['served_tok_s']:,.0f} | {r['ratio']:.2f} | {r['engine_tpot_ms']:.2f} / "
            f"{r['served_tpot_ms']:.2f} | {r['tpot_ratio']:.2f} | {r['ttft_ms_p50']:.0f} / "
            f"{r['ttft_ms_p99']:.0f} | {r['itl_ms_p99']:.1f} | {r['chunks_per_request']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1b", choices=["1b", "8b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 32, 128, 256])
    ap.add_argument("--rates", nargs="*", type=float, default=[], help="Poisson arrival rates (req/s)")
    ap.add_argument("--rate-requests", type=int, default=256)
    ap.add_argument("--prompts", nargs="+", default=["short", "long"], choices=list(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--buckets", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--kv-cache-tokens", type=int, default=1 << 19)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--app-args", default="{}", help="JSON merged into the app's args (ingress replicas, ...)")
    ap.add_argument("--unary-levels", nargs="*", type=int, default=[])
    ap.add_argument("--profile-streams", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from policies.graph_policy import GraphPolicy
    from workers.modeling.default_model import BENCH_CONFIGS, build_byte_tokenizer, tiny_hf_config, write_checkpoint
    from workers.serving.engine import LLMEngine
    from workers.serving.engine_config import EngineConfig

    work = Path(tempfile.mkdtemp())
    model_dir = work / f"llama-{args.config}-random"
    tokenizer = build_byte_tokenizer()
    shape = tiny_hf_config(len(tokenizer)) if args.config == "tiny" else BENCH_CONFIGS[args.config]
    write_checkpoint(model_dir, shape, tokenizer, seed=0)
    printable_outputs(model_dir)
    gpu = args.device == "cuda"
    policy = GraphPolicy(decode_batch_buckets=args.buckets, compile=not args.no_compile and gpu)
    max_num_seqs = max(args.buckets)
    settings = dict(
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        kv_cache_tokens=args.kv_cache_tokens,
        compile_cache_dir=str(work / "inductor"),
    )
    levels = [(p, c, None) for p in args.prompts for c in args.streams]
    levels += [(p, args.rate_requests, r) for p in args.prompts for r in args.rates]

    engine, tok = LLMEngine.from_config(
        EngineConfig(model=str(model_dir), device=args.device, graph_policy=policy, **settings)
    )
    alone = {}
    for prompt, streams, rate in levels:
        ids = tok(PROMPTS[prompt])["input_ids"]
        engine_level(engine, ids, arrivals(min(streams, 8), None), 8)  # warm-up
        alone[(prompt, streams, rate)] = engine_level(engine, ids, arrivals(streams, rate), args.max_tokens)
        print("engine", prompt, streams, rate, len(ids), "tokens", alone[(prompt, streams, rate)], flush=True)
    prompt_tokens = {p: len(tok(PROMPTS[p])["input_ids"]) for p in args.prompts}
    del engine
    if gpu:
        torch.cuda.empty_cache()

    import ray
    from ray import serve

    from app import deployment

    os.environ.pop("GRAPHSERVE_API_KEYS", None)
    os.environ["GRAPHSERVE_ADMIN_TOKEN"] = ADMIN
    ray.init(num_cpus=os.cpu_count(), num_gpus=1 if gpu else 0, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    app_args = {
        "model": str(model_dir),
        "accelerator": "gpu" if gpu else "cpu",
        "cuda_graph_policy": policy.model_dump(mode="json"),
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "controller_state_path": str(work / "state.json"),
        **settings,
        **json.loads(args.app_args),
    }
    t0 = time.perf_counter()
    serve.run(deployment(app_args), blocking=False)
    while True:
        try:
            if urllib.request.urlopen("http://127.0.0.1:8000/readyz", timeout=2).status == 200:
                break
        except Exception:
            time.sleep(0.5)
    ready_s = time.perf_counter() - t0
    print(f"app ready in {ready_s:.1f} s", flush=True)

    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, cpu = [], {}
    for prompt, streams, rate in levels:
        profiling = args.profile_streams == streams and rate is None and prompt == "short"
        samples, stop = [], threading.Event()
        sampler = threading.Thread(target=cpu_sampler, args=(stop, samples), daemon=True)
        sampler.start()
        spies = []
        served = asyncio.run(
            served_level(
                "http://127.0.0.1:8000",
                model_dir.name,
                PROMPTS[prompt],
                arrivals(streams, rate),
                args.max_tokens,
                on_start=(lambda spies=spies: spies.extend(profile(out_dir, 6))) if profiling else (lambda: None),
            )
        )
        stop.set()
        for spy in spies:
            spy.wait()
        peak = {role: max(s[role] for s in samples) for role in samples[0]} if samples else {}
        mean = {role: statistics.fmean(s[role] for s in samples) for role in samples[0]} if samples else {}
        cpu[f"{prompt}-{streams}-{rate}"] = {"peak": peak, "mean": mean}
        e = alone[(prompt, streams, rate)]
        row = {
            "model_shape": args.config,
            "prompt": prompt,
            "prompt_tokens": prompt_tokens[prompt],
            "streams": streams,
            "engine_tok_s": e["output_token_throughput"],
            "served_tok_s": served["output_token_throughput"],
            "ratio": served["output_token_throughput"] / e["output_token_throughput"],
            "engine_tpot_ms": e["tpot_ms"]["median"],
            "served_tpot_ms": served["tpot_ms"]["median"],
            "tpot_ratio": served["tpot_ms"]["median"] / e["tpot_ms"]["median"],
            "ttft_ms_p50": served["ttft_ms"]["median"],
            "ttft_ms_p99": served["ttft_ms"]["p99"],
            "itl_ms_p99": served["itl_ms"]["p99"],
            "chunks_per_request": served["chunks_per_request"],
            "engine": e,
            "served": served,
            "cpu_percent": cpu[f"{prompt}-{streams}-{rate}"],
        }
        if rate is not None:
            row["request_rate"] = rate
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("engine", "served")}, flush=True)
    unary = (
        asyncio.run(unary_knee("http://127.0.0.1:8000", model_dir.name, args.unary_levels, 2000))
        if (args.unary_levels)
        else []
    )
    serve.shutdown()
    ray.shutdown()
    meta = {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "config": args.config,
        "max_model_len": args.max_model_len,
        "buckets": args.buckets,
        "compile": policy.compile,
        "max_tokens": args.max_tokens,
        "serve_run_to_ready_s": ready_s,
        "app_args": json.loads(args.app_args),
        "cpus": os.cpu_count(),
    }
    result = {"meta": meta, "rows": rows, "unary_max_tokens_1": unary}
    if args.profile_streams:
        result["profile"] = profile_summary(out_dir)
    write_report(args.out, result, table(rows))


if __name__ == "__main__":
    main()
