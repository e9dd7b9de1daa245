"""Compile seconds cold and warm: the same engine started twice in fresh processes that share one
inductor cache directory (`compile_cache_dir`), as a restarted replica with a cache
volume would. Random weights of real shape; each start is a new Python process, so nothing is
reused in memory, only what the directory holds.

    python -m bench.compile_cache --config 1b --max-model-len 8192 --out bench/results/compile_cache_h200.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUCKETS = (1, 8, 32, 64, 128, 256)


def start_once(config: str, max_model_len: int, cache_dir: str) -> dict:
    """One engine start with compile in this process: its compile and startup seconds."""
    from policies.graph_policy import GraphPolicy
    from workers.modeling.synthetic import random_model
    from workers.serving.engine import LLMEngine
    from workers.serving.engine_config import EngineConfig

    t0 = time.perf_counter()
    model = random_model(config, max_model_len, "cuda")
    policy = GraphPolicy(compile=True, decode_batch_buckets=BUCKETS)
    config = EngineConfig(
        max_num_seqs=max(BUCKETS), max_model_len=max_model_len, graph_policy=policy, compile_cache_dir=cache_dir
    )
    engine = LLMEngine(model, config)
    compiled = [b for b, r in engine.status().buckets.items() if r["compiled"]]
    return dict(compile_s=engine.runner.compile_s, startup_s=time.perf_counter() - t0, compiled_buckets=compiled)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1b")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the cache directory, in a child start
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(start_once(args.config, args.max_model_len, args.child)))
        return
    runs = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in ("cold", "warm"):
            cmd = [
                sys.executable,
                __file__,
                "--config",
                args.config,
                "--max-model-len",
                str(args.max_model_len),
                "--child",
                cache_dir,
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[name] = json.loads(out.strip().splitlines()[-1])
            print(name, runs[name], flush=True)
    result = dict(config=args.config, max_model_len=args.max_model_len, buckets=BUCKETS, **runs)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
