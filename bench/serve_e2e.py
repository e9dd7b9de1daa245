"""End-to-end streamed TPOT through Ray Serve vs the engine's own, on one GPU, in one run.

1. Writes a checkpoint of the Llama-3.2-1B shape (random bf16 weights, the byte tokenizer) to disk.
2. Engine alone: c concurrent greedy requests of N tokens in-process, added at once; TPOT per
   request and tokens/s.
3. The Serve app on the same checkpoint: time until /readyz (capture complete), then per level one
   `openai` client opens its connections with a warm-up round and runs c concurrent streamed
   completions: TPOT per stream (client clock, first to last chunk), aggregate tokens/s, when each
   stream's first chunk came, and the replica's own prefill/decode steps and busy time over the round
   (did the engine slow down, or did the time go elsewhere?), and when each request started in the
   proxy, the ingress and the replica (from Serve's request logs: where a burst's ramp comes from).

`--throughput-optimized` runs Ray with `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` (Ray Serve's own mode:
no proxy hop (the ingress replica serves HTTP itself), gRPC between deployments, user code on the
replica's main loop); the request logs then stay unbuffered so the stage times still come back.

    python -m bench.serve_e2e --out bench/results/serve_e2e_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from bench.openai_load import one_stream

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
# Before every measured round, served or not: replicas report every second, and both sides then
# start from the same idle GPU and CPU (an idle device takes a few ms to clock up).
IDLE_BEFORE_ROUND_S = 2.5
SERVE_LOGS = Path("/tmp/ray/session_latest/logs/serve")
# Serve's request log: the line is written when a request ends, with its duration.
REQUEST_LINE = re.compile(
    r"^INFO (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* -- (?:POST /v1/completions \d+|CALL generate \w+) ([\d.]+)ms"
)
STAGE_LOGS = {"proxy": "proxy_*.log", "ingress": "replica_*_Ingress_*.log", "replica": "replica_*_LLMReplica_*.log"}


def write_model(path: Path) -> None:
    from workers.modeling.synthetic import BENCH_CONFIGS, build_byte_tokenizer, write_checkpoint

    write_checkpoint(path, BENCH_CONFIGS["1b"], build_byte_tokenizer(), seed=0)


def counters(stats: dict) -> dict[str, float]:
    """The cumulative engine counters a level's difference is taken of."""
    return {
        "prefill_steps": stats["prefill_steps"],
        "decode_steps": stats["decode_steps"],
        "generated_tokens": stats["generated_tokens"],
        "prefill_busy_s": stats["busy_s"]["prefill"],
        "decode_busy_s": stats["busy_s"]["decode"],
    }


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counters over one level, plus the engine's own time per decode step and per prefill."""
    d = {k: after[k] - before[k] for k in after}
    d["decode_ms_per_step"] = d["decode_busy_s"] / max(d["decode_steps"], 1) * 1e3
    d["prefill_ms_per_step"] = d["prefill_busy_s"] / max(d["prefill_steps"], 1) * 1e3
    d["tokens_per_busy_s"] = d["generated_tokens"] / max(d["prefill_busy_s"] + d["decode_busy_s"], 1e-9)
    return d


def engine_alone(model_dir: str, streams: int, max_tokens: int, max_model_len: int) -> dict:
    from workers.serving.engine import LLMEngine
    from workers.serving.engine_config import EngineConfig
    from workers.serving.sampling import SamplingParams

    engine, tokenizer = LLMEngine.from_config(EngineConfig(model=model_dir, max_model_len=max_model_len))
    prompt = tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the first round warms the allocator and prefill kernels
        time.sleep(IDLE_BEFORE_ROUND_S)
        before = counters(engine.stats.snapshot())
        seqs = [engine.add_request(prompt, params) for _ in range(streams)]
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        wall = time.perf_counter() - t0
    tpots = [(s.last_token_time - s.first_token_time) / (len(s.output_ids) - 1) for s in seqs]
    result = dict(
        tpot_ms=statistics.median(tpots) * 1e3,
        tokens_per_s=sum(len(s.output_ids) for s in seqs) / wall,
        steps=difference(counters(engine.stats.snapshot()), before),
        wall_s=wall,
    )
    del engine
    torch.cuda.empty_cache()
    return result


async def serve_level(base_url: str, model: str, streams: int, max_tokens: int) -> dict:
    """`streams` concurrent streams from one client whose connections are already open (a warm-up
    round first, as any long-lived client has), and the replica's own counters over the level."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    await asyncio.gather(*[one_stream(client, model, PROMPT, 8, 0.0) for _ in range(streams)])
    await asyncio.sleep(IDLE_BEFORE_ROUND_S)
    before = engine_counters()
    t0, t0_wall = time.monotonic(), time.time()
    results = await asyncio.gather(*[one_stream(client, model, PROMPT, max_tokens, 0.0) for _ in range(streams)])
    wall = time.monotonic() - t0
    await asyncio.sleep(IDLE_BEFORE_ROUND_S)
    stages = stage_starts(t0_wall, t0_wall + wall)
    # The replica's own steps and busy time: did the engine itself slow down (more prefill steps,
    # a slower step) or did the time go in transport?
    steps = difference(engine_counters(), before)
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    first_ms = sorted((r["first"] - t0) * 1e3 for r in results if r["first"] is not None)
    return dict(
        tpot_ms=statistics.median(tpots) * 1e3,
        tokens_per_s=sum(r["tokens"] for r in results) / wall,
        completion_tokens=[r["tokens"] for r in results],
        wall_s=wall,
        steps=steps,
        first_chunk_ms=dict(min=first_ms[0], median=first_ms[len(first_ms) // 2], max=first_ms[-1]),
        stage_start_ms=stages,
    )


def stage_starts(since: float, until: float) -> dict[str, dict]:
    """When the round's requests started in each Serve stage, in ms after `since` (wall clock)."""
    out = {}
    for stage, pattern in STAGE_LOGS.items():
        starts = []
        for path in SERVE_LOGS.glob(pattern):
            for line in path.read_text(errors="replace").splitlines():
                m = REQUEST_LINE.match(line)
                if m:
                    end = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    start = end - float(m[2]) / 1e3
                    if since - 0.05 <= start <= until:
                        starts.append((start - since) * 1e3)
        if starts:
            starts.sort()
            out[stage] = dict(n=len(starts), min=starts[0], median=starts[len(starts) // 2], max=starts[-1])
    return out


def replica_statuses() -> dict:
    admin = urllib.request.Request(
        "http://127.0.0.1:8000/admin/status", headers={"Authorization": "Bearer bench-admin"}
    )
    return json.loads(urllib.request.urlopen(admin).read())["replicas"]


def engine_counters() -> dict[str, float]:
    """Cumulative engine counters summed over all replicas."""
    totals: dict[str, float] = {}
    for status in replica_statuses().values():
        for key, value in counters(status["stats"]).items():
            totals[key] = totals.get(key, 0) + value
    return totals


def wait_ready(base_url: str, timeout_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        try:
            if urllib.request.urlopen(base_url + "/readyz", timeout=2).status == 200:
                return time.perf_counter() - t0
        except Exception:
            time.sleep(0.5)
    raise TimeoutError("the app never became ready")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--stream-interval-ms", type=float, default=20.0)
    ap.add_argument("--throughput-optimized", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    model_dir = Path(tempfile.mkdtemp()) / "llama-1b-random"
    t0 = time.perf_counter()
    write_model(model_dir)
    print(f"checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
    alone = {c: engine_alone(str(model_dir), c, args.max_tokens, args.max_model_len) for c in args.streams}
    print("engine alone", alone, flush=True)

    import ray
    from ray import serve

    from app import deployment

    os.environ.pop("GRAPHSERVE_API_KEYS", None)
    os.environ["GRAPHSERVE_ADMIN_TOKEN"] = "bench-admin"
    if args.throughput_optimized:  # before ray.init: every Ray process reads it when it starts
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
        os.environ["RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE"] = "1"
    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    app = deployment(
        {
            "model": str(model_dir),
            "accelerator": "gpu",
            "max_model_len": args.max_model_len,
            "autoscaling": {"min_replicas": 1, "max_replicas": 1},
            "stream_interval_ms": args.stream_interval_ms,
            "controller_state_path": str(model_dir.parent / "state.json"),
        }
    )
    t0 = time.perf_counter()
    serve.run(app, blocking=False)
    ready_s = time.perf_counter() - t0 + wait_ready("http://127.0.0.1:8000", 600)
    admin = urllib.request.Request(
        "http://127.0.0.1:8000/admin/status", headers={"Authorization": "Bearer bench-admin"}
    )
    replicas = json.loads(urllib.request.urlopen(admin).read())["replicas"]
    captured = {rid: {b: r["capture_s"] for b, r in s["buckets"].items() if r["ready"]} for rid, s in replicas.items()}
    print("replica states", {rid: s["state"] for rid, s in replicas.items()}, "captured", captured, flush=True)
    rows = []
    for c in args.streams:
        served = asyncio.run(serve_level("http://127.0.0.1:8000", model_dir.name, c, args.max_tokens))
        rows.append(
            dict(
                streams=c,
                replica_steps=served["steps"],
                engine_alone_steps=alone[c]["steps"],
                e2e_wall_s=served["wall_s"],
                engine_alone_wall_s=alone[c]["wall_s"],
                first_chunk_ms=served["first_chunk_ms"],
                stage_start_ms=served["stage_start_ms"],
                engine_tpot_ms=alone[c]["tpot_ms"],
                e2e_tpot_ms=served["tpot_ms"],
                tpot_ratio=served["tpot_ms"] / alone[c]["tpot_ms"],
                engine_tokens_per_s=alone[c]["tokens_per_s"],
                e2e_tokens_per_s=served["tokens_per_s"],
                throughput_ratio=served["tokens_per_s"] / alone[c]["tokens_per_s"],
                throughput_vs_replica_engine=served["tokens_per_s"] / served["steps"]["tokens_per_busy_s"],
                completion_tokens=served["completion_tokens"],
            )
        )
        print(rows[-1], flush=True)
    serve.shutdown()
    ray.shutdown()
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        max_tokens=args.max_tokens,
        stream_interval_ms=args.stream_interval_ms,
        throughput_optimized=args.throughput_optimized,
        serve_run_to_ready_s=ready_s,
        captured_buckets=captured,
        model="1b-shape random bf16, byte tokenizer",
    )
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
