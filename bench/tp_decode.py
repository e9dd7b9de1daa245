"""Decode with tensor parallelism on several GPUs of one host: TPOT at each batch size for TP = 1 and
TP = 2, eager and full CUDA graphs, each rank's captured buckets, and rank 0's control cost per step.

Each rank is a process of its own with its own GPU, NCCL between them: rank 0 runs the engine and
hands each model call to the other ranks over the step channel, which replay the same bucket (the
serving path of `workers/front/shard_worker.py`, without Ray around it). Random bf16 weights of a real shape.
Control cost is the host time rank 0 spends in `StepChannel.send` per step (the header and inputs
broadcast before each replay); TP = 1 runs without a channel, as a TP = 1 replica does.

    python -m bench.tp_decode --out bench/results/tp_decode_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import queue
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.decode_tpot import PROMPT_LEN, engine_tpot, percentile
from policies.graph_policy import GraphPolicy
from workers.front.shard_worker import prepare_follower
from workers.modeling.synthetic import random_model
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.tensor_parallel.tp import Follower, StepChannel, init_tp_group

WARMUP_STEPS = 20


class TimedChannel(StepChannel):
    """The step channel, counting rank 0's host time per send."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seconds, self.sends = 0.0, 0

    def send(self, op: int, rows: int = 0, values: list[int] | None = None) -> None:
        t0 = time.perf_counter()
        super().send(op, rows, values)
        self.seconds += time.perf_counter() - t0
        self.sends += 1


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    device = torch.device("cuda", rank)
    tp = init_tp_group(rank, world, f"tcp://127.0.0.1:{port}", device, timeout_s=600)
    model = random_model(args.config, PROMPT_LEN + args.steps + WARMUP_STEPS + 40, device, tp=tp)
    for mode in args.modes:
        config = EngineConfig(
            max_num_seqs=max(args.batch_sizes), max_model_len=model.max_model_len, graph_policy=GraphPolicy(mode=mode)
        )
        if rank > 0:
            runners = prepare_follower(model, config)
            Follower(StepChannel(tp, device), runners).follow()
            results.put(dict(rank=rank, mode=mode, buckets=runners.base.report()))
            del runners
        else:
            channel = TimedChannel(tp, device) if world > 1 else None
            engine = LLMEngine(model, config, channel=channel)
            results.put(dict(rank=0, mode=mode, buckets=engine.runner.report()))
            for bs in args.batch_sizes:
                if channel is not None:
                    channel.seconds, channel.sends = 0.0, 0
                times = engine_tpot(engine, bs, args.steps, WARMUP_STEPS)
                control = channel.seconds / channel.sends * 1e3 if channel is not None else None
                results.put(
                    dict(
                        tp=world,
                        mode=mode,
                        batch_size=bs,
                        tpot_ms=statistics.median(times),
                        p99_ms=percentile(times, 0.99),
                        control_ms_per_step=control,
                    )
                )
            engine.stop_followers()
            del engine
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = []
    while any(p.is_alive() for p in procs) or not results.empty():
        try:
            out.append(results.get(timeout=1))
            print(world, out[-1] if "tpot_ms" in out[-1] else {k: out[-1][k] for k in ("rank", "mode")}, flush=True)
        except queue.Empty:
            continue
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"TP = {world}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="8b")
    ap.add_argument("--tp-sizes", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--modes", nargs="+", default=["eager", "full"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows, captures = [], []
    for world in args.tp_sizes:
        for item in run_world(world, args):
            if "buckets" in item:
                captures.append(dict(tp=world, **item))
            else:
                rows.append(item)
    meta = dict(
        device=torch.cuda.get_device_name(),
        gpus=torch.cuda.device_count(),
        torch=torch.__version__,
        nccl=".".join(map(str, torch.cuda.nccl.version())),
        config=args.config,
        steps=args.steps,
        prompt_len=PROMPT_LEN,
    )
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "captures": captures}, indent=1))


if __name__ == "__main__":
    main()
