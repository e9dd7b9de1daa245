"""Tensor-parallel lockstep: process-group set-up, and the channel over which rank 0 hands every
model call's inputs to the other ranks.

Rank 0 runs the scheduler and sampling; before each model call it broadcasts one fixed-size int64
buffer holding a header (operation and sizes) and up to CAPACITY input ints. A collective costs
about the same for 32 bytes as for 8 KB, so a decode step (3 ints per row) costs one broadcast,
filled by one host-to-device copy; only a longer input (a large prefill) sends its remainder in a
second broadcast. The other ranks loop in `follow`, making the same call on the same inputs, so
every rank replays the same bucket and meets the same all-reduces. No Ray call happens per step.
Every wait is bounded by the process group's timeout, and an idle rank 0 sends heartbeats so a
follower can tell "idle" from "dead".
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from workers.modeling.lora import load_adapter
from workers.serving.step_inputs import DecodeInputs, PrefillInputs

if TYPE_CHECKING:
    from workers.graphs.graph_runner import StepRunners
from workers.tensor_parallel.parallel import TPGroup

log = logging.getLogger(__name__)

NOOP, PREFILL, DECODE, EAGER, STOP, LORA_LOAD = range(6)
HEADER = 4  # op, rows, payload length, spare
CAPACITY = 1024  # payload ints sent with the header: a decode step of up to 341 rows fits


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
        self.buffer = torch.zeros(HEADER + CAPACITY, dtype=torch.int64, device=device)
        # Rank 0 fills the header and payload here, then copies them to `buffer` in one go; pinned
        # on CUDA so the copy is asynchronous, and `copied` says when it may be overwritten.
        self.staging = torch.zeros(HEADER + CAPACITY, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def send(self, op: int, rows: int = 0, values: list[int] | None = None) -> None:
        values = values or []
        n = HEADER + min(len(values), CAPACITY)
        if self.copied is not None:
            self.copied.synchronize()  # the previous send's copy has finished reading `staging`
        self.staging.numpy()[:n] = [op, rows, len(values), 0, *values[:CAPACITY]]
        self.buffer[:n].copy_(self.staging[:n], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        dist.broadcast(self.buffer, src=0, group=self.tp.group)
        if len(values) > CAPACITY:
            rest = torch.tensor(values[CAPACITY:], dtype=torch.int64, device=self.device)
            dist.broadcast(rest, src=0, group=self.tp.group)

    def recv(self) -> tuple[int, int, list[int]]:
        dist.broadcast(self.buffer, src=0, group=self.tp.group)
        received = self.buffer.cpu()  # one device-to-host copy of header and payload
        op, rows, length, _ = received[:HEADER].tolist()
        values = received[HEADER : HEADER + min(length, CAPACITY)].tolist()
        if length > CAPACITY:
            rest = torch.empty(length - CAPACITY, dtype=torch.int64, device=self.device)
            dist.broadcast(rest, src=0, group=self.tp.group)
            values += rest.tolist()
        return op, rows, values


def load_adapter_shard(runners: StepRunners, slot: int, others: list[int], path: str) -> None:
    """A follower's part of rank 0's adapter load: its shard of the adapter into the same slot, then
    the same verification on the same probe (whose replays and all-reduce pair with rank 0's)."""
    model = runners.lora.model
    model.lora.load(slot, load_adapter(path, path, model.cfg, model.lora.max_rank, model.embed.weight.device))
    runners.lora.check_adapter(slot, others)


def follow(channel: StepChannel, runners: StepRunners) -> None:
    """A follower rank's loop: repeat rank 0's model calls until STOP (or a collective times out)."""
    with torch.inference_mode():
        while True:
            op, rows, values = channel.recv()
            if op == STOP:
                return
            if op == NOOP:
                continue
            if op == LORA_LOAD:  # rows: the slot; values: the other loaded slots' count, them, the path
                others = values[1 : 1 + values[0]]
                load_adapter_shard(runners, rows, others, bytes(values[1 + values[0] :]).decode())
            elif op == PREFILL:
                batch = PrefillInputs.from_ints(rows, values)
                runners.of(batch).prefill(batch)
            else:
                batch = DecodeInputs.from_ints(rows, values)
                runner = runners.of(batch)
                (runner.decode if op == DECODE else runner.eager)(batch)
