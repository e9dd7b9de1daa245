"""Start-up time through the Serve app, cold and warm, and what compiling once costs the decode step.

`startup`: for each config (the Llama-3.2-1B or Llama-3.1-8B shape, random bf16 weights, the byte
tokenizer) the Serve app with the GPU defaults (max_num_seqs 256: the default 17-bucket ladder,
compile on) and max_model_len 8192 is started twice on one compile cache directory: cold (the
directory empty) and warm (what the cold start left). Each start is a fresh process (its own Ray
instance), so only the directory carries over; ready_s runs from `serve.run` to /readyz answering
200, and the replica's /admin/status gives the engine's phases and the replica's own start.

`tpot`: the decode step compiled once by layer with a dynamic row count (what the engine does) against
the old way, the whole step compiled per bucket shape (`PerShapeStep`, a switch of this script only), each in its own
process: engine step TPOT (decode only, at each `--contexts` live length, max_model_len 8192) and the
CUDA-graph replay alone, at each batch size, which is also a bucket.

Rows are merged into --out (JSON, keyed by config and start or batch size) and the markdown beside
it is written from all of them, so configs can be run one device command at a time (`--configs tiny`:
the embedded tiny model on the CPU, a smoke run of the start-up part, nothing compiled):

    python -m bench.startup startup --configs 1b --out bench/results/startup_h200.json
    python -m bench.startup startup --configs 8b --out bench/results/startup_h200.json
    python -m bench.startup tpot --configs 1b 8b --out bench/results/startup_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BASE = "http://127.0.0.1:8000"
ADMIN = {"Authorization": "Bearer bench-admin"}
MAX_MODEL_LEN = 8192
CONTEXTS = (256, 4096)  # live context lengths of the tpot rows
TPOT_BATCH_SIZES = (1, 8, 32, 128)
READY_TIMEOUT_S = 540
TARGETS = {"1b": {"cold": 60, "warm": 20}, "8b": {"cold": 90, "warm": 30}}  # seconds to /readyz (issue 30)
TPOT_TARGET = 1.03  # dynamic / per-shape


def child(*args: str) -> dict:
    """Run this script's `args` in a fresh Python process; its last stdout line is its JSON answer."""
    cmd = [sys.executable, "-m", "bench.startup", *args]
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_model(config: str, path: Path) -> None:
    from workers.modeling.synthetic import BENCH_CONFIGS, build_byte_tokenizer, write_checkpoint

    write_checkpoint(path, BENCH_CONFIGS[config], build_byte_tokenizer(), seed=0, device="cuda")


def admin_status() -> dict:
    request = urllib.request.Request(BASE + "/admin/status", headers=ADMIN)
    return json.loads(urllib.request.urlopen(request, timeout=10).read())


def seconds_to_ready(t0: float) -> float:
    while time.perf_counter() - t0 < READY_TIMEOUT_S:
        try:
            if urllib.request.urlopen(BASE + "/readyz", timeout=2).status == 200:
                return time.perf_counter() - t0
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the app was not ready within {READY_TIMEOUT_S} s")


def start_once(config: str, model_dir: str, cache_dir: str, start: str) -> dict:
    """One start of the Serve app in this process: its row."""
    import ray
    from ray import serve

    from app import deployment

    os.environ.pop("GRAPHSERVE_API_KEYS", None)
    os.environ["GRAPHSERVE_ADMIN_TOKEN"] = "bench-admin"
    gpu = config != "tiny"
    args = {
        "max_model_len": MAX_MODEL_LEN if gpu else 256,
        "compile_cache_dir": cache_dir,
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "controller_state_path": str(Path(cache_dir).parent / f"state-{start}.json"),
    }
    if gpu:
        args |= {"model": model_dir, "accelerator": "gpu"}
    ray.init(num_cpus=8 if gpu else 4, num_gpus=int(gpu), include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    t0, t0_epoch = time.perf_counter(), time.time()
    serve.run(deployment(args), blocking=False)
    ready_s = seconds_to_ready(t0)
    (replica,) = admin_status()["replicas"].values()
    serve.shutdown()
    ray.shutdown()
    buckets = replica["buckets"]
    startup = replica["startup"]
    return {
        "config": config,
        "start": start,
        "buckets": len(buckets),
        "compiled_buckets": sum(b["ready"] and b["compiled"] for b in buckets.values()),
        "compiled_graphs": startup["compiled_graphs"],
        "ready_s": ready_s,
        "replica_init_s": startup["started_at"] - t0_epoch,  # Serve placing and starting the replica's actor
        "replica_s": startup["replica_s"],
        "controller_s": startup["controller_s"],
        "engine_start_s": startup["engine_start_s"],
        "engine_s": startup["total_s"],
        "phases": startup["phases"],
        "first_call_s": startup["first_call_s"],
    }


def startup_rows(config: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, cache_dir = Path(tmp) / f"llama-{config}-random", Path(tmp) / "compile-cache"
        if config != "tiny":
            child("--child-write", config, str(model_dir))
        rows = []
        for start in ("cold", "warm"):
            row = child("--child-start", config, str(model_dir), str(cache_dir), start)
            row["cache_mb"] = sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file()) / 2**20
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows


class PerShapeStep:
    """The old way, for this comparison only: the whole step compiled once per bucket shape (static)."""

    def __init__(self, model) -> None:
        import torch

        self.fn = torch.compile(model.decode, dynamic=False, options={"triton.cudagraphs": False})

    def __call__(self, *args):
        return self.fn(*args)


def replay_ms(replay, n: int = 100) -> float:
    """Device time of one CUDA-graph replay, from n back to back."""
    import torch

    for _ in range(5):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def tpot_once(config: str, variant: str, steps: int, contexts: list[int]) -> dict:
    """One engine of `variant` (dynamic | per_shape) in this process: its compile and its times per
    context and batch size."""
    from bench.decode_tpot import long_context_tpot
    from policies.graph_policy import GraphPolicy
    from workers.graphs import graph_runner
    from workers.modeling.synthetic import random_model
    from workers.serving.engine import LLMEngine
    from workers.serving.engine_config import EngineConfig

    if variant == "per_shape":
        graph_runner.CompiledStep = PerShapeStep
    model = random_model(config, MAX_MODEL_LEN, "cuda")
    policy = GraphPolicy(compile=True, decode_batch_buckets=TPOT_BATCH_SIZES)
    engine = LLMEngine(
        model, EngineConfig(max_num_seqs=max(TPOT_BATCH_SIZES), max_model_len=MAX_MODEL_LEN, graph_policy=policy)
    )
    runner = engine.runner
    assert runner.table.ready == set(TPOT_BATCH_SIZES), runner.report()
    times = {}
    for context in contexts:
        for bs in TPOT_BATCH_SIZES:
            tpot = statistics.median(long_context_tpot(engine, bs, context, steps, warmup=10))
            times[f"{context}/{bs}"] = {"tpot_ms": tpot, "replay_ms": replay_ms(runner._replays[bs])}
    return {"compile_s": runner.compile_s, "graphs": runner.graphs, "times": times}


def tpot_rows(config: str, steps: int, contexts: list[int]) -> list[dict]:
    lengths = ",".join(map(str, contexts))
    runs = {v: child("--child-tpot", config, v, str(steps), lengths) for v in ("dynamic", "per_shape")}
    print(json.dumps(runs), flush=True)
    dynamic, per_shape = runs["dynamic"], runs["per_shape"]
    rows = []
    for context, bs in itertools.product(contexts, TPOT_BATCH_SIZES):
        d, p = dynamic["times"][f"{context}/{bs}"], per_shape["times"][f"{context}/{bs}"]
        rows.append(
            {
                "config": config,
                "context": context,
                "batch_size": bs,
                "dynamic_tpot_ms": d["tpot_ms"],
                "per_shape_tpot_ms": p["tpot_ms"],
                "tpot_ratio": d["tpot_ms"] / p["tpot_ms"],
                "dynamic_replay_ms": d["replay_ms"],
                "per_shape_replay_ms": p["replay_ms"],
                "replay_ratio": d["replay_ms"] / p["replay_ms"],
                "dynamic_graphs": dynamic["graphs"],
                "per_shape_graphs": per_shape["graphs"],
                "dynamic_compile_s": dynamic["compile_s"],
                "per_shape_compile_s": per_shape["compile_s"],
            }
        )
    return rows


def merge(old: list[dict], new: list[dict], key: tuple[str, ...]) -> list[dict]:
    """old's rows, each replaced by a new row of the same key; new keys appended."""
    fresh = {tuple(r[k] for k in key): r for r in new}
    kept = [fresh.pop(tuple(r[k] for k in key), r) for r in old]
    return kept + list(fresh.values())


def slowest_first_calls(row: dict, n: int = 2) -> str:
    """Where the compile phase went: the buckets whose first decode step took longest."""
    calls = sorted(row.get("first_call_s", {}).items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"bs {b}: {s:.1f}" for b, s in calls)


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# Start-up: compile once, capture every bucket",
        "",
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}. Serve app, GPU defaults (max_num_seqs 256: "
        f"the default ladder, compile on), max_model_len {MAX_MODEL_LEN}, random bf16 weights. ready_s: `serve.run` "
        "to /readyz 200; cold: an empty compile_cache_dir, warm: the same directory again (each start a new "
        "process). Command: `python -m bench.startup startup --configs 1b` (then 8b), `... tpot --configs 1b 8b`.",
        "",
        "| config | start | buckets (compiled) | graphs | ready_s (target) | replica actor up | replica_s "
        "| controller | engine process | engine_s | load | allocate | compile | capture | verify | warmup | cache MB "
        "| slowest first steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")  # rows measured before the replica reported these parts
    for r in result.get("startup", []):
        p = r["phases"]
        target = TARGETS.get(r["config"], {}).get(r["start"])
        ready = f"{r['ready_s']:.1f}" + (f" (<= {target})" if target else "")
        lines.append(
            f"| {r['config']} | {r['start']} | {r['buckets']} ({r['compiled_buckets']}) | {r['compiled_graphs']} | "
            f"{ready} | {r.get('replica_init_s', nan):.1f} | {r['replica_s']:.1f} | {r.get('controller_s', nan):.1f} | "
            f"{r.get('engine_start_s', nan):.1f} | {r['engine_s']:.1f} | "
            + " | ".join(f"{p[k]:.1f}" for k in ("load", "allocate", "compile", "capture", "verify", "warmup"))
            + f" | {r['cache_mb']:.0f} | {slowest_first_calls(r)} |"
        )
    lines += [
        "",
        "Decode step, compiled once by layer (dynamic rows) vs whole per bucket shape (the old way), "
        "at each live context length: "
        f"engine step TPOT (median) and CUDA-graph replay alone; target ratio <= {TPOT_TARGET}.",
        "",
        "| config | context | bs | TPOT ms dynamic | per shape | ratio | replay ms dynamic | per shape | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.get("tpot", []):
        lines.append(
            f"| {r['config']} | {r['context']} | {r['batch_size']} | "
            f"{r['dynamic_tpot_ms']:.3f} | {r['per_shape_tpot_ms']:.3f} | "
            f"{r['tpot_ratio']:.3f} | {r['dynamic_replay_ms']:.3f} | {r['per_shape_replay_ms']:.3f} | "
            f"{r['replay_ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def meta() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu", "torch": torch.__version__, "triton": None}
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("--child-"):
        what, *args = sys.argv[1:]
        if what == "--child-write":
            write_model(args[0], Path(args[1]))
            print("{}")
        elif what == "--child-start":
            print(json.dumps(start_once(*args)))
        elif what == "--child-meta":
            print(json.dumps(meta()))
        else:
            print(json.dumps(tpot_once(args[0], args[1], int(args[2]), [int(c) for c in args[3].split(",")])))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["startup", "tpot"])
    ap.add_argument("--configs", nargs="+", choices=["tiny", "1b", "8b"], default=["1b"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS, help="tpot: live context lengths")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    for row in result.get("tpot", []):
        row.setdefault("context", 256)  # rows from before --contexts were measured at 256
    for config in args.configs:
        if args.what == "startup":
            result["startup"] = merge(result.get("startup", []), startup_rows(config), ("config", "start"))
        else:
            rows = tpot_rows(config, args.steps, args.contexts)
            result["tpot"] = merge(result.get("tpot", []), rows, ("config", "context", "batch_size"))
        result["meta"] = child("--child-meta")  # not here: a CUDA context in this process would shrink the KV pools
        out.write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
