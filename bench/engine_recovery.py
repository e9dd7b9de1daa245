"""How a replica comes back when its engine process is killed under load, through the real Serve app.

1. Serves a checkpoint (`--config tiny`: the embedded tiny model on CPU; `1b` / `8b`: the
   Llama-3.2-1B / Llama-3.1-8B shape with random bf16 weights on the GPU, graphs captured) with
   `max_num_seqs` slots and more streams than slots, so some requests decode while others wait in
   the engine's queue.
2. Once `max_num_seqs` streams have text, SIGKILLs the engine process and measures, from the kill:
   when the replica reports READY again (the restart in place: a new process, load, warm-up,
   capture, verify), when a fresh request sent right after the kill is answered 200, and how every
   stream ended (an error event then [DONE], or complete; none may be cut off).

    python -m bench.engine_recovery --config tiny --out bench/results/engine_recovery_cpu.json
    python -m bench.engine_recovery --config 1b --out bench/results/engine_recovery_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import httpx

ADMIN = {"Authorization": "Bearer bench-admin"}
BASE = "http://127.0.0.1:8000"


def engine_pids() -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if b"workers.front.engine_main" in (proc / "cmdline").read_bytes().split(b"\0"):
                    pids.add(int(proc.name))
            except OSError:
                continue
    return pids


async def stream(http: httpx.AsyncClient, model: str, max_tokens: int, had_text: asyncio.Event) -> str:
    """How one stream ended: "complete", "error_event" (an error event, then [DONE]) or "cut"."""
    body = {
        "model": model,
        "prompt": "Hello",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if events[-1] != "[DONE]" and json.loads(events[-1]).get("choices", [{}])[0].get("text"):
                        had_text.set()
    except httpx.HTTPError:
        return "cut"
    if not events or events[-1] != "[DONE]":
        return "cut"
    last = json.loads(events[-2]) if len(events) > 1 else {}
    return "error_event" if "error" in last else "complete"


async def reported_ready_again(http: httpx.AsyncClient, killed: float) -> float:
    """Seconds from the kill until the replica reports READY with one more engine restart (the
    replica reports every second, so this is up to a second late)."""
    while True:
        replicas = (await http.get("/admin/status", headers=ADMIN)).json()["replicas"]
        if any(r["state"] == "READY" and r.get("engine_restarts", 0) >= 1 for r in replicas.values()):
            return time.monotonic() - killed
        await asyncio.sleep(0.1)


async def measure(model: str, streams: int, running: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=BASE, timeout=600) as http:
        flags = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.create_task(stream(http, model, max_tokens, f)) for f in flags]
        deadline = time.monotonic() + 120
        while sum(f.is_set() for f in flags) < running:
            assert time.monotonic() < deadline, "the streams never started"
            await asyncio.sleep(0.01)
        had_text_at_kill = [f.is_set() for f in flags]
        (pid,) = engine_pids()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        ready_again = asyncio.create_task(reported_ready_again(http, killed))
        probe = {"model": model, "prompt": "Hi", "max_tokens": 4, "temperature": 0}
        refusals, served_s = 0, None
        while served_s is None:
            r = await http.post("/v1/completions", json=probe)
            if r.status_code == 200:
                served_s = time.monotonic() - killed
            else:
                refusals += 1
                await asyncio.sleep(0.05)
        endings = await asyncio.gather(*tasks)
        replica = next(iter((await http.get("/admin/status", headers=ADMIN)).json()["replicas"].values()))
    return {
        "serves_again_after_s": served_s,
        "replica_reported_ready_again_after_s": await ready_again,
        "probe_refusals": refusals,
        "streams": streams,
        "decoding_at_kill": sum(had_text_at_kill),
        "endings": {kind: endings.count(kind) for kind in ("complete", "error_event", "cut")},
        "decoding_streams_ended_with_error_event": all(
            e == "error_event" for e, had in zip(endings, had_text_at_kill) if had
        ),
        "engine_restarts": replica["engine_restarts"],
        "replica_state": replica["state"],
        "new_engine_pid": pid not in engine_pids() and bool(engine_pids()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=["tiny", "1b", "8b"], default="tiny")
    ap.add_argument("--streams", type=int, default=6)  # 4 decoding, 2 waiting: the probe finds a free slot after
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import ray
    from ray import serve

    from app import deployment

    tmp = Path(tempfile.mkdtemp())
    app_args = {
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "autoscaling": {"min_replicas": 1, "max_replicas": 1},
        "controller_state_path": str(tmp / "state.json"),
    }
    if args.config != "tiny":
        from workers.modeling.synthetic import BENCH_CONFIGS, build_byte_tokenizer, write_checkpoint

        model_dir = tmp / f"llama-{args.config}-random"
        write_checkpoint(model_dir, BENCH_CONFIGS[args.config], build_byte_tokenizer(), seed=0)
        app_args |= {"model": str(model_dir), "accelerator": "gpu"}
    os.environ.pop("GRAPHSERVE_API_KEYS", None)
    os.environ["GRAPHSERVE_ADMIN_TOKEN"] = "bench-admin"
    os.environ["GRAPHSERVE_CACHE"] = str(tmp / "cache")
    ray.init(
        num_cpus=4 if args.config == "tiny" else 8, num_gpus=0 if args.config == "tiny" else 1, include_dashboard=False
    )
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    t0 = time.monotonic()
    serve.run(deployment(app_args), blocking=False)
    start_s = time.monotonic() - t0
    status = httpx.get(BASE + "/admin/status", headers=ADMIN).json()
    replica = next(iter(status["replicas"].values()))
    captured = sorted(b for b, r in replica["buckets"].items() if r["ready"])
    model = status["model"]
    result = asyncio.run(measure(model, args.streams, args.max_num_seqs, args.max_tokens))
    serve.shutdown()
    ray.shutdown()
    meta = {
        "config": args.config,
        "max_num_seqs": args.max_num_seqs,
        "max_tokens": args.max_tokens,
        "max_model_len": args.max_model_len,
        "serve_run_s": start_s,
        "captured_buckets": captured,
    }
    if args.config != "tiny":
        import torch

        meta |= {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out = {"meta": meta, "result": result}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
