"""A prefill of a few new tokens, as rows of the replayed decode step against the prefill path
(prefill graphs' pieces with attention between them, or eager above their ladder), per call.

For each shape, context and token count: one sequence's `tokens` new tokens after `context`
positions already in its pages, through `GraphRunner.prefill` with the rule of
`policies/cached_prefill.py` forced each way; host-timed calls (synchronized), median of
`--repeats` after warm-up. The engine is built as a server builds it (default ladders, graphs
captured and verified), random bf16 weights of real shapes, one GPU. `rule` is what the engine
picks for that call.

    python -m bench.prefill_rows --configs 1b 8b --out bench/results/prefill_rows_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

from bench.prefix_cache import bench_model, free_device_memory
from bench.report import write_report
from policies import cached_prefill
from policies.graph_policy import GraphPolicy
from workers.graphs.graph_runner import GraphRunner
from workers.model_runner.step_inputs import PrefillInputs
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig

SLOT = 0


@contextmanager
def rows_rule(max_tokens: int):
    """The rule's token bound set to `max_tokens` (0: never rows) for the calls inside."""
    kept = cached_prefill.DECODE_ROWS_MAX_TOKENS
    cached_prefill.DECODE_ROWS_MAX_TOKENS = max_tokens
    try:
        yield
    finally:
        cached_prefill.DECODE_ROWS_MAX_TOKENS = kept


def call_ms(runner: GraphRunner, batch: PrefillInputs, repeats: int) -> tuple[float, str]:
    """Median ms of one prefill call, and how it ran (its dispatch's bucket id)."""
    for _ in range(3):
        _, dispatch = runner.prefill(batch)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.prefill(batch)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    if dispatch.decode_rows:
        how = runner.bucket_id(dispatch.bucket)
    else:
        how = runner.prefill_bucket_id(dispatch.bucket) if dispatch.bucket else "eager"
    return statistics.median(times), how


def run_config(name: str, args: argparse.Namespace) -> list[dict]:
    model = bench_model(name, args.max_model_len, "cuda")
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_model_len=model.max_model_len,
        graph_policy=GraphPolicy(compile=args.compile),
        enable_prefix_caching=False,
    )
    engine = LLMEngine(model, config)
    runner, cache = engine.runner, engine.cache
    longest = max(args.contexts) + max(args.tokens)
    pages = -(-longest // cache.page_size)
    cache.set_pages([v for i in range(pages) for v in (SLOT, i, 1 + i)])  # the engine is idle: any pages
    g = torch.Generator().manual_seed(0)
    rows = []
    for context in args.contexts:
        for tokens in args.tokens:
            ids = torch.randint(0, model.cfg.vocab_size, (tokens,), generator=g).tolist()
            positions = list(range(context, context + tokens))
            batch = PrefillInputs(ids, positions, [SLOT] * tokens, [0] * tokens, [tokens])
            with rows_rule(0):
                prefill_ms, prefill_how = call_ms(runner, batch, args.repeats)
            with rows_rule(1 << 30):
                rows_ms, rows_how = call_ms(runner, batch, args.repeats)
            rows.append(
                {
                    "config": name,
                    "context": context,
                    "tokens": tokens,
                    "rows_ms": rows_ms,
                    "rows_as": rows_how,
                    "prefill_ms": prefill_ms,
                    "prefill_as": prefill_how,
                    "rows_over_prefill": rows_ms / prefill_ms,
                    "rule": "rows" if cached_prefill.prefill_as_decode_rows([tokens], [context]) else "prefill",
                }
            )
            print(rows[-1], flush=True)
    del engine, runner, cache, model
    free_device_memory("cuda")
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# A prefill of a few tokens: rows of the replayed decode step vs the prefill path",
        "",
        f"{meta['device']}, torch {meta['torch']}; max_model_len {meta['max_model_len']}, max_num_seqs "
        f"{meta['max_num_seqs']} (decode buckets up to it), compile {meta['compile']}; one sequence's new tokens "
        f"after `context` positions in its pages; ms per call (host-timed, synchronized), median of {meta['repeats']}.",
        "",
        "| config | context | new tokens | rows ms (bucket) | prefill path ms (how) | rows / prefill | rule |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['context']} | {r['tokens']} | {r['rows_ms']:.3f} ({r['rows_as']}) | "
            f"{r['prefill_ms']:.3f} ({r['prefill_as']}) | {r['rows_over_prefill']:.2f} | {r['rule']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["1b"], choices=["1b", "8b"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[0, 512, 2000, 8000])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 32, 48, 64, 128])
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--compile", action="store_true", help="compile the decode step, as the GPU defaults do")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = [row for name in args.configs for row in run_config(name, args)]
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "compile": args.compile,
        "repeats": args.repeats,
    }
    write_report(args.out, {"meta": meta, "rows": rows}, markdown(meta, rows))


if __name__ == "__main__":
    main()
