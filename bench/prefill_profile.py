"""Where one prefill step's time goes: torch.profiler over an engine step whose prompt is (a) all
new, 2,032 tokens, and (b) 32 new tokens after a cached 2,000-token prefix, on random weights of a
real shape; the top operators by self CPU and by device time, then the median wall time of such
steps without a profiler and the host's Python functions by own time (cProfile) over them,
written to --out as markdown.

    python -m bench.prefill_profile --config 1b --out bench/results/prefill_profile_h200.md
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.prefix_cache import bench_model, make_engine, random_tokens, sync
from workers.serving.sampling import SamplingParams


def fenced(text: str) -> str:
    return f"```\n{text.rstrip()}\n```\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="1b")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = bench_model(args.config, 4096, "cuda")
    engine = make_engine(model, caching=True, max_num_seqs=8)
    rng, vocab = random.Random(0), model.cfg.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    report = []

    def stage(cached: bool) -> None:
        """Queue the step to time: 32 new tokens after a 2,000-token prefix (cached first if asked)."""
        prefix = random_tokens(rng, 2000, vocab)
        if cached:
            engine.add_request(prefix + random_tokens(rng, 32, vocab), params)
            while engine.has_work():
                engine.step()
        engine.add_request(prefix + random_tokens(rng, 32, vocab), params)
        sync(engine)

    for name, cached in (("all new", False), ("cached prefix", True)):
        for _ in range(3):  # warm: the same shapes as the profiled step
            stage(False)
            while engine.has_work():
                engine.step()
        stage(cached)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.step()
            sync(engine)
            wall = (time.perf_counter() - start) * 1e3
        table = prof.key_averages()
        report.append(f"## {name}: step {wall:.2f} ms under the profiler\n")
        report.append(fenced(table.table(sort_by="self_cpu_time_total", row_limit=25)))
        report.append(fenced(table.table(sort_by="self_cuda_time_total", row_limit=15)))
        walls, host = [], cProfile.Profile()
        for profiled in [False] * 10 + [True] * 10:  # timed without cProfile, then profiled
            stage(cached)
            start = time.perf_counter()
            if profiled:
                host.enable()
            engine.step()
            sync(engine)
            host.disable()
            if not profiled:
                walls.append((time.perf_counter() - start) * 1e3)
        out = io.StringIO()
        pstats.Stats(host, stream=out).sort_stats("tottime").print_stats(30)
        report.append(f"## {name}: step {statistics.median(walls):.2f} ms median of 10; host functions over 10 more\n")
        report.append(fenced(out.getvalue()))
    device = torch.cuda.get_device_name()
    title = f"# Where a prefill step's time goes ({args.config}, {device}, torch {torch.__version__})\n"
    command = f"`python -m bench.prefill_profile {' '.join(sys.argv[1:])}`\n"
    Path(args.out).write_text("\n".join([title, *report, command]))
    print("\n".join(line for line in report if line.startswith("##")))


if __name__ == "__main__":
    main()
