"""Per-step control overhead of tensor-parallel lockstep, on one GPU.

The same engine and model (Llama-3.2-1B shape, random bf16, full CUDA graphs) decode with and
without the step channel: with it, rank 0 broadcasts each step's header and inputs over a (here
one-rank) NCCL group before replaying, exactly as it does for followers at TP > 1. The difference in
TPOT is the control overhead per step.

    python -m bench.tp_overhead --out bench/results/tp_overhead_h200.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from bench.decode_tpot import PROMPT_LEN, engine_tpot, percentile
from workers.modeling.synthetic import random_model
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.tensor_parallel.tp import StepChannel, init_tp_group


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    device = torch.device("cuda", 0)
    tp = init_tp_group(0, 1, f"tcp://127.0.0.1:{port}", device, timeout_s=60)
    model = random_model("1b", PROMPT_LEN + args.steps + 40, device)
    config = EngineConfig(max_num_seqs=32, max_model_len=model.max_model_len)
    rows = []
    for bs in args.batch_sizes:
        timings = {}
        for name, channel in (("in_process", None), ("step_channel", StepChannel(tp, device))):
            engine = LLMEngine(model, config, channel=channel)
            timings[name] = engine_tpot(engine, bs, args.steps, 20)
            del engine
        base, chan = (statistics.median(timings[k]) for k in ("in_process", "step_channel"))
        rows.append(
            dict(
                batch_size=bs,
                tpot_ms_in_process=base,
                tpot_ms_step_channel=chan,
                overhead_ms=chan - base,
                overhead_ratio=chan / base,
                p99_in_process=percentile(timings["in_process"], 0.99),
                p99_step_channel=percentile(timings["step_channel"], 0.99),
            )
        )
        print(rows[-1], flush=True)
    dist.destroy_process_group()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, config="1b", mode="full")
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
