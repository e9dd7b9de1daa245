"""A burst of concurrent streamed requests against the Serve app after it sat idle: when each
stream's first chunk arrives and how long the whole burst takes (real `openai` client).

Runs on any machine (the embedded tiny model; captured graphs where there is a GPU). It measures the
request path, not the engine: with the tiny model a step is cheap, so what a burst waits for is
the client, the proxy, the ingress, the replica and the controller look-ups on the way.

    python -m bench.serve_burst --out bench/results/serve_burst_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

PORT = 8011


async def one_stream(client, tokens: int) -> float:
    stream = await client.completions.create(
        model="tiny-llama-v1",
        prompt="hello there",
        max_tokens=tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = None
    async for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
    return first


async def bursts(streams: int, rounds: int, tokens: int, idle_s: float) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", max_retries=0, timeout=60)
    await asyncio.gather(*[one_stream(client, tokens) for _ in range(streams)])  # opens the connections
    out = []
    for _ in range(rounds):
        await asyncio.sleep(idle_s)
        t0 = time.perf_counter()
        firsts = sorted(
            (f - t0) * 1e3 for f in await asyncio.gather(*[one_stream(client, tokens) for _ in range(streams)])
        )
        out.append(
            {
                "wall_ms": (time.perf_counter() - t0) * 1e3,
                "first_chunk_ms": {"min": firsts[0], "median": firsts[len(firsts) // 2], "max": firsts[-1]},
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--idle-s", type=float, default=2.5, help="idle time before each burst")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import ray
    from ray import serve

    from app import deployment

    os.environ.pop("GRAPHSERVE_API_KEYS", None)
    state = Path(tempfile.mkdtemp()) / "state.json"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(
        deployment(
            {
                "replica_num_cpus": 0.5,
                "ingress_num_cpus": 0.25,
                "max_model_len": 256,
                "controller_state_path": str(state),
            }
        ),
        blocking=False,
    )
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{PORT}/readyz", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.5)
    rounds = asyncio.run(bursts(args.streams, args.rounds, args.tokens, args.idle_s))
    serve.shutdown()
    ray.shutdown()
    summary = {
        "median_wall_ms": statistics.median(r["wall_ms"] for r in rounds),
        "median_last_first_chunk_ms": statistics.median(r["first_chunk_ms"]["max"] for r in rounds),
    }
    Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary, "rounds": rounds}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
