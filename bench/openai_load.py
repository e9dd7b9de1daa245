"""Streams from the real `openai` client, spread over client processes, so the load generator is
not what is measured.

One process of `openai.AsyncOpenAI` spends 6-8 ms of its one core per 256-token stream on the
H200's host (request building, the SSE parse and a pydantic object per chunk;
`bench/results/serve_load_client_processes_h200.md`): 256 streams started at once keep it busy for
most of the round, and their time to first chunk is partly the client's own queue. `run_streams`
hands each of N processes (`python -m bench.openai_load`, which imports neither torch nor Ray) its
share of the streams. Each warms its connections, says so, and starts its streams together with
the others at one instant the parent chooses (CLOCK_MONOTONIC is one clock for every process of the
machine). Then it reports each stream's times and the CPU it spent.

The protocol, one JSON line each way: the parent writes the share, the child answers `ready`, the
parent writes the start instant, the child answers its result.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

WARM_STREAMS = 16  # per process, before the measured round: opens connections, and reaches every ingress
# replica behind a balancer (the first request an ingress replica handles costs it more than the next)
WARM_PROMPT = "Warm-up."  # none of the round's prompts: the warm-up leaves them nothing cached


async def one_stream(
    client, model: str, prompt: str, max_tokens: int, start_at: float, response_format: dict | None = None
) -> dict:
    """One streamed completion arriving at `start_at` (monotonic), under `response_format` if given:
    its times (`end` and `first` absolute; ttft and tpot None when no chunk carried a choice)."""
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    start = time.monotonic()
    chunks, tokens = [], 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **({"response_format": response_format} if response_format else {})},
    )
    async for chunk in stream:
        if chunk.choices:
            chunks.append(time.monotonic())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.monotonic()
    first, last = (chunks[0], chunks[-1]) if chunks else (None, None)
    return {
        "ttft": first - start if chunks else None,
        "tpot": (last - first) / (tokens - 1) if tokens > 1 and last > first else None,
        "first": first,
        "itl": [b - a for a, b in zip(chunks, chunks[1:])],
        "e2e": end - start,
        "tokens": tokens,
        "chunks": len(chunks),
        "end": end,
    }


async def _share(spec: dict, read_line: Callable[[], str]) -> dict:
    import openai

    clients = {
        url: openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for url in spec["urls"]
    }
    streams = [(clients[url], offset, prompt) for url, offset, prompt in spec["streams"]]
    model, response_format = spec["model"], spec["response_format"]
    warm = [streams[i % len(streams)][0] for i in range(WARM_STREAMS)]  # as many as a round of few streams too
    # under the round's response_format: its grammar is compiled (and cached) before the round
    await asyncio.gather(*[one_stream(c, model, WARM_PROMPT, 4, 0.0, response_format) for c in warm])
    print("ready", flush=True)
    start_at = json.loads(await asyncio.to_thread(read_line))["start_at"]
    cpu = time.process_time()
    rows = await asyncio.gather(
        *[
            one_stream(c, model, prompt, spec["max_tokens"], start_at + offset, response_format)
            for c, offset, prompt in streams
        ]
    )
    cpu = time.process_time() - cpu
    for client in clients.values():
        await client.close()
    return {"rows": list(rows), "cpu_s": cpu}


def run_streams(
    urls: list[str],
    model: str,
    prompts: list[str],
    offsets: list[float],
    max_tokens: int,
    processes: int,
    idle_s: float,
    on_start: Callable[[], None] = lambda: None,
    response_format: dict | None = None,
) -> tuple[list[dict], float, float]:
    """Stream i sends prompts[i] and arrives at offset i (s) after a common start, through
    urls[i % len(urls)], from process i % processes. Returns every stream's times (in the order of
    `offsets`), the round's wall time (start to the last stream's end) and the client processes'
    CPU seconds. `idle_s`: the server idles this long between the warm-up and the round;
    `on_start` runs at the start. Every request, warm-up included, asks for `response_format`
    (OpenAI's object, sent as /v1/completions takes it) when given."""
    shares = [[] for _ in range(min(processes, len(offsets)))]
    for i, (offset, prompt) in enumerate(zip(offsets, prompts, strict=True)):
        shares[i % len(shares)].append((urls[i % len(urls)], offset, prompt))
    root = Path(__file__).resolve().parent.parent
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.openai_load"],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in shares
    ]
    try:
        for child, share in zip(children, shares):
            spec = {
                "urls": urls,
                "model": model,
                "streams": share,
                "max_tokens": max_tokens,
                "response_format": response_format,
            }
            child.stdin.write(json.dumps(spec) + "\n")
            child.stdin.flush()
        for child in children:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client process failed before the round (exit {child.wait()})")
        time.sleep(idle_s)
        start_at = time.monotonic() + 0.05
        for child in children:
            child.stdin.write(json.dumps({"start_at": start_at}) + "\n")
            child.stdin.flush()
        on_start()
        results = []
        for child in children:
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"a client process failed in the round (exit {child.wait()})")
            results.append(json.loads(line))
    finally:
        for child in children:
            child.stdin.close()
            child.wait(timeout=60)
    rows = [results[i % len(shares)]["rows"][i // len(shares)] for i in range(len(offsets))]
    wall = max(row["end"] for row in rows) - start_at
    return rows, wall, sum(r["cpu_s"] for r in results)


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    result = asyncio.run(_share(spec, sys.stdin.readline))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
