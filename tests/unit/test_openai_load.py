"""The benchmark's client processes (`bench/openai_load.py`): streams spread over several
processes of the real `openai` client start together at the instant the parent chooses, each at its
offset, and every stream's times come back. Against a minimal SSE server in this process."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from bench.openai_load import WARM_PROMPT, run_streams

CHUNKS = 3
CHUNK = {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
BODIES: list[dict] = []  # what the server was sent, in order


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Every POST: CHUNKS text chunks, a usage chunk, [DONE]; keep-alive."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")
            )
            BODIES.append(json.loads(await reader.readexactly(length)))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            events = [{**CHUNK, "choices": [{"index": 0, "text": "ab", "finish_reason": None}]}] * CHUNKS
            events.append(
                {
                    **CHUNK,
                    "choices": [],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 2 * CHUNKS, "total_tokens": 7},
                }
            )
            for data in [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]:
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
                await asyncio.sleep(0.005)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


@pytest.fixture
def sse_url():
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(_answer, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def test_streams_from_two_processes_start_together_at_their_offsets(sse_url):
    offsets = [0.0, 0.0, 0.3, 0.3, 0.0, 0.0]  # stream i goes to process i % 2: a late one in each
    prompts = [f"prompt {i}" for i in range(len(offsets))]
    BODIES.clear()
    rows, wall, cpu_s = run_streams([sse_url], "m", prompts, offsets, 6, processes=2, idle_s=0.0)
    assert len(rows) == len(offsets) and cpu_s > 0
    sent = [b["prompt"] for b in BODIES]
    assert sorted(p for p in sent if p != WARM_PROMPT) == prompts  # each stream its own prompt, once
    assert all("response_format" not in b for b in BODIES)
    assert all(r["chunks"] == CHUNKS and r["tokens"] == 2 * CHUNKS and r["ttft"] > 0 for r in rows)
    starts = [r["end"] - r["e2e"] for r in rows]
    early = [t for t, offset in zip(starts, offsets) if offset == 0.0]
    late = [t for t, offset in zip(starts, offsets) if offset > 0.0]
    assert max(early) - min(early) < 0.25  # one start for both processes
    assert min(late) - min(early) >= 0.29  # the late ones waited for their offset
    assert wall >= 0.3 and wall >= max(r["e2e"] for r in rows)


def test_every_request_of_a_constrained_round_carries_its_response_format(sse_url):
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
    BODIES.clear()
    rows, _, _ = run_streams([sse_url], "m", ["a", "b", "c"], [0.0] * 3, 6, 2, 0.0, response_format=fmt)
    assert len(rows) == 3
    warm = [b for b in BODIES if b["prompt"] == WARM_PROMPT]
    assert warm and len(warm) < len(BODIES)  # the warm-up compiles the grammar before the round
    assert all(b["response_format"] == fmt and b["ignore_eos"] is True for b in BODIES)
