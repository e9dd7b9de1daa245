"""Tensor-parallel lockstep: process-group set-up, and the channel over which rank 0 hands every
model call's inputs to the other ranks.

Rank 0 runs the scheduler and sampling; before each model call it broadcasts a fixed-size header
(operation and sizes) and then the inputs as one int64 tensor. The other ranks loop in `follow`,
making the same call on the same inputs, so every rank replays the same bucket and meets the same
all-reduces. No Ray call happens per step. Every wait is bounded by the process group's timeout,
and an idle rank 0 sends heartbeats so a follower can tell "idle" from "dead".
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from workers.parallel import TPGroup

log = logging.getLogger(__name__)

NOOP, PREFILL, DECODE, EAGER, STOP = range(5)
HEADER = 4  # op, rows, payload length, spare


def init_tp_group(rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the shards' process group (NCCL on GPU, gloo on CPU); the rank comes from the caller."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None,
    )  # fmt: skip
    return TPGroup(rank=rank, world_size=world_size, group=dist.group.WORLD)


class StepChannel:
    """Broadcasts (op, int lists) from rank 0; the other ranks receive them in the same order."""

    def __init__(self, tp: TPGroup, device: torch.device) -> None:
        self.tp = tp
        self.device = device
        self.header = torch.zeros(HEADER, dtype=torch.int64, device=device)

    def send(self, op: int, rows: int = 0, values: list[int] | None = None) -> None:
        values = values or []
        self.header.copy_(torch.tensor([op, rows, len(values), 0]))
        dist.broadcast(self.header, src=0, group=self.tp.group)
        if values:
            dist.broadcast(torch.tensor(values, dtype=torch.int64, device=self.device), src=0, group=self.tp.group)

    def recv(self) -> tuple[int, int, list[int]]:
        dist.broadcast(self.header, src=0, group=self.tp.group)
        op, rows, length, _ = self.header.tolist()
        if not length:
            return op, rows, []
        payload = torch.empty(length, dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0, group=self.tp.group)
        return op, rows, payload.tolist()


def follow(channel: StepChannel, model, runner, cache) -> None:
    """A follower rank's loop: repeat rank 0's model calls until STOP (or a collective times out)."""
    with torch.inference_mode():
        while True:
            op, rows, values = channel.recv()
            if op == STOP:
                return
            if op == NOOP:
                continue
            if op == PREFILL:
                n = (len(values) - rows) // 3  # tokens, positions, slots of n tokens; then `rows` prompt lengths
                tokens, positions, slots, lens = values[:n], values[n : 2 * n], values[2 * n : 3 * n], values[3 * n :]
                t = torch.tensor([tokens, positions, slots], dtype=torch.int64).to(cache.k.device)
                model.prefill(t[0], t[1], t[2], lens, cache)
            else:
                tokens, positions, slots = values[:rows], values[rows : 2 * rows], values[2 * rows :]
                (runner.decode if op == DECODE else runner.eager)(tokens, positions, slots)
