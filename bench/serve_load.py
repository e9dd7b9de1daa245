"""What a client gets against what the engine makes, in one run: the engine alone (in-process, the
same config) and the Serve app through the real `openai` client (in `--client-processes` processes
that start together, `bench/openai_load.py`: one is saturated by a few hundred streams), at fixed
concurrency levels and at Poisson arrival rates, with short and long prompts. Metrics are named as
`vllm bench serve` names them: TTFT, TPOT, ITL and E2E latency (mean, median, p99, in ms), request
throughput and output token throughput. ITL is the gap between two streamed chunks (a chunk may
carry several tokens: the replica coalesces a stream's tokens).

Every stream of a level sends the same prompt (after the first, its prefill is cached), or with
--distinct-prompts its own: a tag of the round and the stream's index first, so no page of one
prompt is another's, in any round, and every prefill is whole.

With --schema NAME (one of `bench/structured_output.py`'s schemas), every level runs again with each
request under that JSON schema (`response_format` of type json_schema on /v1/completions, the
engine's requests alike), after its free run: what structured outputs cost a client against the
same level free, in one run. --tokenizer DIR gives the checkpoint a real tokenizer (SmolLM2's, saved
by `python -m bench.structured_output --save-tokenizer DIR`): under the byte tokenizer a mask is
256 one-byte tokens, not the costs of a real vocabulary (`bench/mask_cost.py`).

With --unary-levels, the knee of non-streamed `max_tokens: 1` requests: requests/s and latency at
each number of concurrent clients, and the CPU each serving process spends per request.

With --profile-streams N (or --profile-unary C), py-spy samples the ingress, the LLM replica, the
engine child and Serve's proxy while the served level of N streams (short prompts) runs (or the
unary level of C clients); their collapsed stacks and a summary of where each process spends its
samples land beside the JSON.

With --throughput-optimized, Ray runs with `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` and the clients send
to each ingress replica's own HTTP server (direct ingress), not to Serve's proxy. With --haproxy,
Ray also runs with `RAY_SERVE_ENABLE_HA_PROXY=1`: HAProxy takes port 8000 in place of Serve's
Python proxy and forwards to the ingress replicas' own servers, and the clients send to port 8000.

    python -m bench.serve_load --config 1b --out bench/results/serve_load_h200.json
    python -m bench.serve_load --config tiny --device cpu --streams 64 --prompts short --out /tmp/smoke.json
    python -m bench.serve_load --config 1b --streams 8 32 --prompts short --schema nested \
        --tokenizer .gpu/smollm2-tokenizer --out bench/results/serve_load_structured_h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, deque
from pathlib import Path

import torch

from bench.openai_load import run_streams
from bench.report import write_report

TEXT = "The quick brown fox jumps over the lazy dog, and the dog, who had seen it all, sighed. " * 20
PROMPTS = {"short": TEXT[:130], "long": TEXT[:1500]}  # the byte tokenizer: a token per byte (plus BOS)


def stream_prompts(prompt: str, n: int, round_tag: str | None) -> list[str]:
    """The prompts of a round's n streams: PROMPTS[prompt] each, or (with a tag unique to the
    round) each its own, as long, beginning with the tag and the stream's index."""
    text = PROMPTS[prompt]
    if round_tag is None:
        return [text] * n
    return [f"{round_tag}.{i}: {text}"[: len(text)] for i in range(n)]


IDLE_BEFORE_ROUND_S = 2.0
DEFAULT_CLIENT_PROCESSES = max(1, min(8, (os.cpu_count() or 2) // 2))  # a client process saturates: openai_load.py
ADMIN = "bench-admin"
PROCESS_TITLES = {"ingress": "Ingress", "replica": "LLMReplica", "proxy": "ProxyActor"}


def printable_outputs(model_dir: Path, tokenizer) -> None:
    """Random weights choose tokens the tokenizer decodes to nothing (ids past its vocabulary, special
    tokens, bytes of a character cut in two), and empty text sends no SSE event, which would hide the
    streaming cost a real model pays. Zeroing every output row but those of tokens that decode to
    printable text makes each token visible."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state = load_file(path)
    head = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
    keep = torch.zeros(state[head].shape[0], dtype=torch.bool)
    special = set(tokenizer.all_special_ids)
    for i in range(min(len(tokenizer), len(keep))):
        text = tokenizer.decode([i])
        keep[i] = i not in special and text != "" and text.isprintable() and "\ufffd" not in text
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


def engine_level(
    engine, prompts_ids: list[list[int]], offsets: list[float], max_tokens: int, json_schema: str | None = None
) -> dict:
    """The engine alone under the same arrivals (request i with prompts_ids[i], under `json_schema`,
    canonical JSON text, if given): requests are added when they arrive, between steps."""
    from workers.serving.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, json_schema=json_schema)
    time.sleep(IDLE_BEFORE_ROUND_S)
    pending, seqs, arrived = deque(zip(offsets, prompts_ids, strict=True)), [], []
    t0 = time.monotonic()
    while pending or engine.has_work():
        now = time.monotonic() - t0
        while pending and pending[0][0] <= now:
            arrived.append(t0 + now)
            seqs.append(engine.add_request(pending.popleft()[1], params))
        if engine.has_work():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0][0] - (time.monotonic() - t0)))
    wall = time.monotonic() - t0
    rows = []
    for seq, at in zip(seqs, arrived):
        n = len(seq.output_ids)
        tpot = (seq.last_token_time - seq.first_token_time) / (n - 1) if n > 1 else None
        rows.append({"ttft": seq.first_token_time - at, "tpot": tpot, "e2e": seq.last_token_time - at, "tokens": n})
    return summary(rows, wall)


async def unary_level(base_urls: list[str], model: str, concurrency: int, seconds: float) -> dict:
    """Non-streamed `max_tokens: 1` completions from `concurrency` workers for `seconds`: requests/s
    and latency. The client is aiohttp on pooled connections, far cheaper per request than the
    `openai` client, so the server's cost is what is measured. Requests go round-robin over
    base_urls (several ingress replicas serving HTTP themselves)."""
    import aiohttp

    body = {"model": model, "prompt": PROMPTS["short"], "max_tokens": 1, "temperature": 0.0}
    latencies, statuses = [], Counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        deadline = time.perf_counter() + seconds

        async def worker(i: int) -> None:
            url = f"{base_urls[i % len(base_urls)]}/v1/completions"
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                async with session.post(url, json=body) as response:
                    await response.read()
                    statuses[response.status] += 1
                latencies.append(time.perf_counter() - start)

        t0 = time.perf_counter()
        await asyncio.gather(*[worker(i) for i in range(concurrency)])
        wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests_per_s": len(latencies) / wall,
        "latency_ms": percentiles([x * 1e3 for x in latencies]),
        "statuses": dict(statuses),
    }


async def unary_knee(base_urls: list[str], model: str, levels: list[int], seconds: float, on_level=None) -> dict:
    """requests/s at each concurrency level (after a short warm-up at that level), and the CPU each
    serving process spent per request (ms, its threads together); the knee is the lowest level within
    5% of the best: more clients past it only queue."""
    rows = []
    for c in levels:
        await unary_level(base_urls, model, c, min(2.0, seconds))
        stop = on_level(c) if on_level else None
        before = cpu_seconds()
        row = await unary_level(base_urls, model, c, seconds)
        after = cpu_seconds()
        done = sum(row["statuses"].values())
        row["cpu_ms_per_request"] = {role: (after[role] - before[role]) * 1e3 / done for role in after}
        rows.append(row)
        if stop:
            stop()
        print("unary", row, flush=True)
    best = max(r["requests_per_s"] for r in rows)
    knee = next(r for r in rows if r["requests_per_s"] >= 0.95 * best)
    return {"levels": rows, "knee_concurrency": knee["concurrency"], "knee_requests_per_s": knee["requests_per_s"]}


def cpu_seconds() -> dict[str, float]:
    """CPU time (user + system) so far of every serving process, summed per role, and this client's."""
    import psutil

    total = Counter()
    for role, pids in serve_pids(every=True).items():
        for pid in pids:
            times = psutil.Process(pid).cpu_times()
            total[role] += times.user + times.system
    times = psutil.Process().cpu_times()
    total["client"] = times.user + times.system
    return dict(total)


def serve_pids(every: bool = False) -> dict:
    """The ingress, LLM replica, engine child and proxy processes of the running app: a pid per role
    (the last found), or with every, all of each role's pids."""
    import psutil

    pids: dict[str, list[int]] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "workers.front.engine_main" in cmd:
            pids.setdefault("engine", []).append(p.info["pid"])
        for role, title in PROCESS_TITLES.items():
            if cmd.startswith("ray::") and title in cmd.split(" ")[0]:
                pids.setdefault(role, []).append(p.info["pid"])
    return pids if every else {role: found[-1] for role, found in pids.items()}


def profile(out_dir: Path, seconds: float, tag: str = "") -> list[subprocess.Popen]:
    """py-spy record of each serving process for `seconds` (collapsed stacks, idle frames left out),
    into profile_{tag}{role}.txt."""
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))  # a venv's
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
                str(out_dir / f"profile_{tag}{role}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for role, pid in serve_pids().items()
    ]


def stop_profile(spies: list[subprocess.Popen]) -> None:
    for spy in spies:
        spy.wait()


def ingress_urls(direct: bool, host: str, replicas: int, timeout_s: float = 120.0) -> list[str]:
    """Where clients send requests: Serve's proxy on port 8000, or with direct ingress each ingress
    replica's own HTTP server (the controller's target groups list their ports once they run; they
    listen on Serve's HTTP host, this one node's)."""
    if not direct:
        return [f"http://{host}:8000"]
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        groups = ray.get(controller.get_target_groups.remote())
        urls = [
            f"http://{host}:{t.port}"
            for g in groups
            if g.protocol == RequestProtocol.HTTP and g.ingress_deployment_name
            for t in g.targets
        ]
        if len(urls) >= replicas:
            return sorted(urls)
        time.sleep(0.5)
    raise TimeoutError(f"{replicas} ingress replicas did not all serve HTTP within {timeout_s:g} s")


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
        "| shape | prompt | response_format | streams / rate | engine tok/s | served tok/s | ratio | "
        "TPOT engine / served ms | TPOT ratio | TTFT p50 / p99 ms | ITL p99 ms | chunks per request | "
        "client processes (CPU ms per request) "
        "|\n|" + "---|" * 13
    )
    lines = [head]
    for r in rows:
        level = f"{r['request_rate']:g} req/s" if r.get("request_rate") else str(r["streams"])
        lines.append(
            f"| {r['model_shape']} | {r['prompt']} | {r.get('response_format') or '-'} | {level} | "
            f"{r['engine_tok_s']:,.0f} | "
            f"{r['served_tok_s']:,.0f} | {r['ratio']:.2f} | {r['engine_tpot_ms']:.2f} / "
            f"{r['served_tpot_ms']:.2f} | {r['tpot_ratio']:.2f} | {r['ttft_ms_p50']:.0f} / "
            f"{r['ttft_ms_p99']:.0f} | {r['itl_ms_p99']:.1f} | {r['chunks_per_request']:.0f} | "
            f"{r['client_processes']} ({r['client_cpu_ms_per_request']:.1f}) |"
        )
    return "\n".join(lines)


def unary_table(unary: dict) -> str:
    if not unary:
        return ""
    lines = [
        "",
        "",
        "Non-streamed `max_tokens: 1` requests (aiohttp client): knee at "
        f"{unary['knee_concurrency']} concurrent, {unary['knee_requests_per_s']:,.0f} req/s",
        "",
        "| concurrent | req/s | latency p50 / p99 ms | CPU ms per request | statuses |",
        "|---|---|---|---|---|",
    ]
    for r in unary["levels"]:
        lat = r["latency_ms"]
        cpu = ", ".join(f"{role} {ms:.2f}" for role, ms in sorted(r["cpu_ms_per_request"].items()))
        lines.append(
            f"| {r['concurrency']} | {r['requests_per_s']:,.0f} | {lat['median']:.1f} / {lat['p99']:.1f} | "
            f"{cpu} | {r['statuses']} |"
        )
    return "\n".join(lines)


def main() -> None:
    from bench.structured_output import SCHEMAS, load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1b", choices=["1b", "8b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", nargs="*", type=int, default=[1, 32, 128, 256], help="none: no streamed levels")
    ap.add_argument("--rates", nargs="*", type=float, default=[], help="Poisson arrival rates (req/s)")
    ap.add_argument("--rate-requests", type=int, default=256)
    ap.add_argument("--prompts", nargs="+", default=["short", "long"], choices=list(PROMPTS))
    ap.add_argument("--distinct-prompts", action="store_true", help="each stream its own prompt: no prefix cached")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--buckets", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--kv-cache-tokens", type=int, default=1 << 19)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--app-args", default="{}", help="JSON merged into the app's args (ingress replicas, ...)")
    ap.add_argument("--unary-levels", nargs="*", type=int, default=[], help="concurrency levels of the unary knee")
    ap.add_argument("--unary-seconds", type=float, default=10.0, help="measured time of each unary level")
    ap.add_argument("--profile-streams", type=int, default=None)
    ap.add_argument("--profile-unary", type=int, default=None, help="py-spy the unary level of this concurrency")
    ap.add_argument(
        "--throughput-optimized",
        action="store_true",
        help="RAY_SERVE_THROUGHPUT_OPTIMIZED=1: clients talk to the ingress replicas' own HTTP servers, no proxy",
    )
    ap.add_argument(
        "--haproxy",
        action="store_true",
        help="RAY_SERVE_ENABLE_HA_PROXY=1 and RAY_SERVE_THROUGHPUT_OPTIMIZED=1: HAProxy on port 8000 forwards to the "
        "ingress replicas' own HTTP servers",
    )
    ap.add_argument(
        "--client-processes",
        nargs="+",
        type=int,
        default=[DEFAULT_CLIENT_PROCESSES],
        help="processes of openai clients the streams are spread over (several: one row per count)",
    )
    ap.add_argument(
        "--schema",
        choices=list(SCHEMAS),
        help="every level again with each request under this JSON schema (response_format json_schema)",
    )
    ap.add_argument("--tokenizer", help="a saved tokenizer directory for the checkpoint (default: the byte tokenizer)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.throughput_optimized or args.haproxy:  # before Ray is imported: every Ray process reads it at start
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
    if args.haproxy:
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"

    from policies.graph_policy import GraphPolicy
    from workers.modeling.synthetic import BENCH_CONFIGS, build_byte_tokenizer, tiny_hf_config, write_checkpoint
    from workers.serving.engine import LLMEngine
    from workers.serving.engine_config import EngineConfig
    from workers.serving.json_schema import canonical_schema

    work = Path(tempfile.mkdtemp())
    model_dir = work / f"llama-{args.config}-random"
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else build_byte_tokenizer()
    shape = tiny_hf_config(len(tokenizer)) if args.config == "tiny" else BENCH_CONFIGS[args.config]
    write_checkpoint(model_dir, shape, tokenizer, seed=0)
    printable_outputs(model_dir, tokenizer)
    gpu = args.device == "cuda"
    policy = GraphPolicy(decode_batch_buckets=args.buckets, compile=not args.no_compile and gpu)
    max_num_seqs = max(args.buckets)
    settings = dict(
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        kv_cache_tokens=args.kv_cache_tokens,
        compile_cache_dir=str(work / "inductor"),
    )
    schemas = [None] + ([args.schema] if args.schema else [])  # each level free, then constrained
    levels = [(p, c, None, s) for p in args.prompts for c in args.streams for s in schemas]
    levels += [(p, args.rate_requests, r, s) for p in args.prompts for r in args.rates for s in schemas]
    canonical = {s: canonical_schema(SCHEMAS[s]) for s in schemas if s}

    engine, tok = LLMEngine.from_config(
        EngineConfig(model=str(model_dir), device=args.device, graph_policy=policy, **settings)
    )
    alone = {}

    def tag(kind: str, n: int) -> str | None:
        return f"{kind}{n}" if args.distinct_prompts else None

    for n, (prompt, streams, rate, schema) in enumerate(levels):
        warm = [tok(p)["input_ids"] for p in stream_prompts(prompt, min(streams, 8), tag("w", n))]
        engine_level(engine, warm, arrivals(len(warm), None), 8, canonical.get(schema))
        ids = [tok(p)["input_ids"] for p in stream_prompts(prompt, streams, tag("e", n))]
        level = (prompt, streams, rate, schema)
        alone[level] = engine_level(engine, ids, arrivals(streams, rate), args.max_tokens, canonical.get(schema))
        print("engine", *level, len(ids[0]), "tokens", alone[level], flush=True)
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
    ingress_replicas = app_args.get("ingress_autoscaling", {}).get("min_replicas", 1)
    urls = ingress_urls(args.throughput_optimized, "127.0.0.1", ingress_replicas)
    print(f"app ready in {ready_s:.1f} s; clients send to {urls}", flush=True)

    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, ((prompt, streams, rate, schema), processes) in enumerate(itertools.product(levels, args.client_processes)):
        profiling = (
            args.profile_streams == streams
            and rate is None
            and schema is None
            and prompt == "short"
            and processes == args.client_processes[0]
        )
        samples, stop = [], threading.Event()
        sampler = threading.Thread(target=cpu_sampler, args=(stop, samples), daemon=True)
        sampler.start()
        spies = []
        per_request, wall, client_cpu_s = run_streams(
            urls,
            model_dir.name,
            stream_prompts(prompt, streams, tag("s", n)),
            arrivals(streams, rate),
            args.max_tokens,
            processes,
            IDLE_BEFORE_ROUND_S,
            on_start=(lambda spies=spies: spies.extend(profile(out_dir, 6))) if profiling else (lambda: None),
            response_format={"type": "json_schema", "json_schema": {"name": schema, "schema": SCHEMAS[schema]}}
            if schema
            else None,
        )
        served = summary(per_request, wall)
        served["chunks_per_request"] = statistics.median(r["chunks"] for r in per_request)
        stop.set()
        stop_profile(spies)
        peak = {role: max(s[role] for s in samples) for role in samples[0]} if samples else {}
        mean = {role: statistics.fmean(s[role] for s in samples) for role in samples[0]} if samples else {}
        e = alone[(prompt, streams, rate, schema)]
        row = {
            "model_shape": args.config,
            "prompt": prompt,
            "prompt_tokens": prompt_tokens[prompt],
            "response_format": schema,
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
            "cpu_percent": {"peak": peak, "mean": mean},
            "client_processes": processes,
            "client_cpu_ms_per_request": client_cpu_s * 1e3 / len(per_request),
        }
        if rate is not None:
            row["request_rate"] = rate
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("engine", "served")}, flush=True)

    def profile_unary(concurrency: int):
        """py-spy the measured round of one unary level; returns what waits for the profiles."""
        if concurrency != args.profile_unary:
            return None
        spies = profile(out_dir, args.unary_seconds, "unary_")
        return lambda: stop_profile(spies)

    unary = {}
    if args.unary_levels:
        unary = asyncio.run(unary_knee(urls, model_dir.name, args.unary_levels, args.unary_seconds, profile_unary))
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
        "throughput_optimized": args.throughput_optimized,
        "haproxy": args.haproxy,
        "distinct_prompts": args.distinct_prompts,
        "tokenizer": args.tokenizer or "bytes",
        "schema": args.schema,
    }
    result = {"meta": meta, "rows": rows, "unary_max_tokens_1": unary}
    if args.profile_streams or args.profile_unary:
        result["profile"] = profile_summary(out_dir)
    write_report(args.out, result, table(rows) + unary_table(unary))


if __name__ == "__main__":
    main()
