"""What a model swap costs one replica's engine on the GPU, against a cold start.

For each config (random bf16 weights of real shapes written as real sharded safetensors checkpoints,
two of them, other seeds): a cold start of the engine on checkpoint A (load, KV pool, capture and
verify every bucket), an in-place swap to B (weights copied into the parameters the graphs read,
then the gate: eager probe, every bucket re-verified, golden prompts graph vs eager), and a rebuild
to A (the engine freed, a new one started on A, then the gate), in one process. Plain graphs
(compile off: a compiled rebuild also compiles, see `compile_cache_h200.json`). The checkpoint
files are read from the page cache after their first read, as on a replica whose node has them.

    python -m bench.model_swap --configs 1b 8b --out bench/results/model_swap_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from pathlib import Path

import torch

from bench.report import write_report
from policies.graph_policy import GraphPolicy
from workers.modeling.synthetic import BENCH_CONFIGS, build_byte_tokenizer, write_checkpoint
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.model_gate import run_gate, swap_weights_in_place

BUCKETS = (1, 2, 4, 8, 16, 32)


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def measure(name: str, root: Path) -> dict:
    tokenizer = build_byte_tokenizer()
    paths, write_s = {}, {}
    for label, seed in (("a", 1), ("b", 2)):
        _, write_s[label] = timed(
            lambda label=label, seed=seed: paths.setdefault(
                label,
                write_checkpoint(
                    root / f"{name}-{label}", BENCH_CONFIGS[name], tokenizer, seed, max_shard_tensors=64, device="cuda"
                ),
            )
        )
    policy = GraphPolicy(decode_batch_buckets=BUCKETS, compile=False)
    config = EngineConfig(
        model=str(paths["a"]),
        max_num_seqs=max(BUCKETS),
        max_model_len=4096,
        device="cuda",
        kv_cache_tokens=max(BUCKETS) * 4096,
        graph_policy=policy,
    )
    (engine, _), cold_s = timed(lambda: LLMEngine.from_config(config))
    swapped = dataclasses.replace(config, model=str(paths["b"]))
    (_, report), in_place_s = timed(lambda live=engine: swap_weights_in_place(live, swapped))
    del engine
    gc.collect()
    torch.cuda.empty_cache()

    def rebuild() -> tuple[LLMEngine, dict]:
        fresh, fresh_tokenizer = LLMEngine.from_config(config)
        return fresh, run_gate(fresh, fresh_tokenizer, None)

    (engine, rebuild_report), rebuild_s = timed(rebuild)
    row = dict(
        config=name,
        buckets=len(BUCKETS),
        checkpoint_write_s=write_s,
        cold_start_s=cold_s,
        in_place_swap_s=in_place_s,
        in_place_gate_s=report["seconds"],
        rebuild_s=rebuild_s,
        rebuild_gate_s=rebuild_report["seconds"],
        in_place_vs_cold=in_place_s / cold_s,
    )
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| config | cold start (s) | in-place swap (s) | of which gate (s) | rebuild (s) | in-place / cold |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['config']} | {r['cold_start_s']:.2f} | {r['in_place_swap_s']:.2f} | {r['in_place_gate_s']:.2f} "
        f"| {r['rebuild_s']:.2f} | {r['in_place_vs_cold']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["1b", "8b"])
    ap.add_argument("--root", default="/tmp/graphserve-swap-bench")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for name in args.configs:
        rows.append(measure(name, Path(args.root)))
        print(rows[-1], flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, buckets=list(BUCKETS))
    write_report(args.out, {"meta": meta, "rows": rows}, markdown(rows))


if __name__ == "__main__":
    main()
