"""Where structured outputs' masks are best filled: the decode TPOT of a batch with every row under
a JSON schema, over the same batch free, with the masks filled

- `engine`: as the engine does (ahead from `AHEAD_MIN_ROWS` constrained rows on, now below);
- `ahead`: always ahead, in the filler's thread, once the step's tokens are taken;
- `now`: always on the step's thread, after the replay's launch, while the device runs it;
- `ahead, pool N` and `now, pool N`: the same with llguidance's pool of N threads per fill (the
  engine's default on 8 cores or more until this benchmark).

One engine (random weights of a real shape, graphs replayed on CUDA), the schema and prompts of
`bench/structured_output.py`; every variant of a batch size in turn, `--rounds` times over, so a
drift of the machine shows in every variant alike. A round's TPOT is the median step; the table
gives the median of the rounds and, for the fills on the step's thread, what the fill itself took
(median and p90 of its steps): the fills of the real grammar states, not a snapshot.

    python -m bench.mask_fill_placement --tokenizer .gpu/smollm2-tokenizer \\
        --out bench/results/mask_fill_placement_h200.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import llguidance
import torch

from bench.report import write_report
from bench.structured_output import (
    BENCH_SCHEMA,
    PROMPT_LEN,
    add_engine_arguments,
    bench_engine,
    load_tokenizer,
    sync,
)
from workers.serving import batch_sampler
from workers.serving.engine import LLMEngine
from workers.serving.grammar import Grammar, MaskFiller
from workers.serving.json_schema import canonical_schema
from workers.serving.sampling import SamplingParams

ALWAYS, NEVER = 1, 1 << 30  # AHEAD_MIN_ROWS that fill every batch ahead, or none


class PooledFiller(MaskFiller):
    """Fills with llguidance's pool of `threads` threads, now and ahead."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        super().__init__()

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.threads)
        return self._executor

    def fill(self, grammars: list[Grammar], bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
        rows = range(len(grammars)) if rows is None else rows
        pairs = [(g.matcher, r) for g, r in zip(grammars, rows)]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def variants(pool: int) -> dict[str, tuple[int, int] | None]:
    """Name: (AHEAD_MIN_ROWS, pool threads; 0 for one row after another), None for free rows."""
    engine = batch_sampler.AHEAD_MIN_ROWS
    return {
        "free": None,
        "engine": (engine, 0),
        "ahead": (ALWAYS, 0),
        "now": (NEVER, 0),
        f"ahead, pool {pool}": (ALWAYS, pool),
        f"now, pool {pool}": (NEVER, pool),
    }


def measure(engine: LLMEngine, tokenizer, bs: int, schema: str | None, variant, steps: int, seed: int) -> dict:
    """One round: the median step of a fresh batch of bs rows, and the fills on the step's thread."""
    sampler = engine.sampler
    sampler.settle()
    ahead_min, pool = variant or (batch_sampler.AHEAD_MIN_ROWS, 0)
    batch_sampler.AHEAD_MIN_ROWS = ahead_min
    sampler.masks = PooledFiller(pool) if pool else MaskFiller()
    fills = []
    fill = sampler.masks.fill

    def timed_fill(*args):
        start = time.perf_counter()
        fill(*args)
        fills.append((time.perf_counter() - start) * 1e3)

    sampler.masks.fill = timed_fill
    warmup = 10
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + warmup + 8, temperature=0.0, ignore_eos=True, json_schema=schema)
    prompts = [torch.randint(0, len(tokenizer), (PROMPT_LEN,), generator=g).tolist() for _ in range(bs)]
    seqs = [engine.add_request(prompt, params) for prompt in prompts]
    while not all(s.output_ids for s in seqs):
        engine.step()
    times = []
    for i in range(warmup + steps):
        sync(engine.device)
        start = time.perf_counter()
        count = len(fills)
        engine.step()
        sync(engine.device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
            if len(fills) > count:
                fills[count:] = [sum(fills[count:])]
            else:
                fills.append(0.0)
    sampler.settle()
    assert all(s.finish_reason is None for s in seqs), "a row left the batch while timed"
    for seq in seqs:
        engine.abort(seq.request_id)
    fills = sorted(fills[-steps:])
    return {
        "tpot_ms": statistics.median(times),
        "fill_now_ms": statistics.median(fills),
        "fill_now_p90": fills[int(0.9 * len(fills))],
    }


def table(result: dict) -> str:
    names = list(result["variants"])
    lines = [
        f"{result['meta']['device']}, torch {result['meta']['torch']}, `{result['config']}` random weights, "
        f"SmolLM2 tokenizer, mode {result['mode']}, {result['steps']} timed steps a round, {result['rounds']} rounds; "
        f"the engine fills ahead from {result['ahead_min_rows']} constrained rows",
        "",
        "Overhead (constrained TPOT over free, medians of the rounds):",
        "",
        "| bs | free TPOT (ms) | " + " | ".join(names[1:]) + " |",
        "|---" * len(names) + "|---|",
    ]
    for bs, row in result["summary"].items():
        free = row["free"]["tpot_ms"]
        cells = " | ".join(f"{100 * (row[n]['tpot_ms'] / free - 1):+.1f}%" for n in names[1:])
        lines.append(f"| {bs} | {free:.3f} | {cells} |")
    lines += ["", "Fill on the step's thread per step, median / p90 (ms):", ""]
    now = [n for n in names if n.startswith("now")]
    lines += ["| bs | " + " | ".join(now) + " |", "|---" * (len(now) + 1) + "|"]
    for bs, row in result["summary"].items():
        lines.append(
            f"| {bs} | " + " | ".join(f"{row[n]['fill_now_ms']:.3f} / {row[n]['fill_now_p90']:.3f}" for n in now) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_arguments(ap, [1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool", type=int, default=8, help="llguidance threads of the pooled variants")
    ap.add_argument("--out", default="bench/results/mask_fill_placement_h200.json")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    engine = bench_engine(args, tokenizer, PROMPT_LEN + args.steps + 32)
    device = engine.device
    schema = canonical_schema(BENCH_SCHEMA)
    ahead_min_rows = batch_sampler.AHEAD_MIN_ROWS
    named = variants(args.pool)
    rounds = []
    for r in range(args.rounds):
        for bs in args.batch_sizes:
            for name, variant in named.items():
                row = measure(engine, tokenizer, bs, variant and schema, variant, args.steps, 100 * r + bs)
                rounds.append({"round": r, "bs": bs, "variant": name, **row})
                print(rounds[-1], flush=True)
    batch_sampler.AHEAD_MIN_ROWS = ahead_min_rows
    summary = {
        bs: {
            name: {
                key: statistics.median(x[key] for x in rounds if x["bs"] == bs and x["variant"] == name)
                for key in ("tpot_ms", "fill_now_ms", "fill_now_p90")
            }
            for name in named
        }
        for bs in args.batch_sizes
    }
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {
        "meta": {"device": f"{gpu} ({len(os.sched_getaffinity(0))} host cores)", "torch": torch.__version__},
        "config": args.config,
        "mode": engine.config.graph_policy.mode,
        "steps": args.steps,
        "rounds": args.rounds,
        "ahead_min_rows": ahead_min_rows,
        "variants": {
            name: None if v is None else {"ahead_min_rows": v[0], "pool_threads": v[1]} for name, v in named.items()
        },
        "summary": summary,
        "per_round": rounds,
    }
    write_report(args.out, result, table(result))


if __name__ == "__main__":
    main()
