"""What the fill ahead's hand-over is worth in the engine: constrained TPOT with the fill started
beside the step (`MaskFiller.start` returns once its thread has taken the job) against the fill
merely queued to its thread (the code before: the thread waited for the step loop to drop the
interpreter lock), each with and without the read-first order (`LLMEngine._fill_outlasts_step`:
a step reads its tokens before it launches where the last fill ahead outlasted the device's step),
and the free batch, on one engine, in turn, round after round.

The structured-output benchmark's engine and batches (`bench/structured_output.py`: random weights
of `--config`, every row under its record-array schema, greedy, steps back to back as a replica
runs them). Per batch size and variant: the median over rounds of each round's median step time,
and its overhead over the free batch's.

    python -m bench.fill_handover --tokenizer .gpu/smollm2-tokenizer --batch-sizes 8 32 128 \\
        --out bench/results/fill_handover_h200.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading

import torch

from bench.report import write_report
from bench.structured_output import (
    BENCH_SCHEMA,
    PROMPT_LEN,
    add_engine_arguments,
    batch_tpot,
    bench_engine,
    load_tokenizer,
)
from workers.serving.json_schema import canonical_schema

VARIANTS = ["free", "queued", "queued, async always", "started", "started, async always"]


class Queued:
    """The hand-over before: `start` returns without waiting for the thread to take the job."""

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass


def set_variant(engine, name: str) -> None:
    filler = engine.sampler.masks
    filler.wait()
    filler._taken = Queued() if name.startswith("queued") else threading.Semaphore(0)
    engine.__dict__.pop("_fill_outlasts_step", None)
    if name.endswith("async always"):
        engine._fill_outlasts_step = lambda flight: False


def table(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# Fill ahead: started beside the step, or queued to its thread",
        "",
        f"{meta['device']}, torch {meta['torch']}, `{result['config']}` random weights, max_model_len "
        f"{result['max_model_len']}, {result['steps']} steps a round, {result['rounds']} rounds",
        "",
        "| bs | " + " | ".join(VARIANTS) + " |",
        "|---|" + "---|" * len(VARIANTS),
    ]
    for bs, row in result["summary"].items():
        free = row["free"]
        cells = [f"{row[v]:.3f}" if v == "free" else f"{row[v]:.3f} ({row[v] / free - 1:+.1%})" for v in VARIANTS]
        lines.append(f"| {bs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(ap, [8, 32, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default="bench/results/fill_handover_h200.json")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    engine = bench_engine(args, tokenizer, PROMPT_LEN + args.steps + args.warmup + 16)
    schema = canonical_schema(BENCH_SCHEMA)
    rounds = {bs: {v: [] for v in VARIANTS} for bs in args.batch_sizes}
    for r in range(args.rounds):
        for bs in args.batch_sizes:
            for variant in VARIANTS:
                set_variant(engine, variant)
                rows = None if variant == "free" else schema
                out = batch_tpot(engine, tokenizer, bs, rows, args.steps, args.warmup, 100 * r + bs, detail=False)
                rounds[bs][variant].append(out["tpot_ms_median"])
            print(r, bs, {v: round(t[-1], 3) for v, t in rounds[bs].items()}, flush=True)
    set_variant(engine, "started")
    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {
        "meta": {"device": f"{name} ({len(os.sched_getaffinity(0))} host cores)", "torch": torch.__version__},
        "config": args.config,
        "max_model_len": engine.config.max_model_len,
        "steps": args.steps,
        "rounds": args.rounds,
        "tpot_ms_rounds": rounds,
        "summary": {bs: {v: statistics.median(t) for v, t in row.items()} for bs, row in rounds.items()},
    }
    write_report(args.out, result, table(result))


if __name__ == "__main__":
    main()
