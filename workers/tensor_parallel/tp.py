"""Tensor-parallel lockstep: process-group set-up, and the channel over which rank 0 hands every
model call's inputs to the other ranks.

Rank 0 runs the scheduler and sampling; before each model call it broadcasts one fixed-size int64
buffer holding a header (operation and sizes) and up to CAPACITY input ints. A collective costs
about the same for 32 bytes as for 8 KB, so a decode step (4 ints per row: token, position, slot,
adapter; and 3 per page-table edit) of up to ~250 rows costs one broadcast, filled by one
host-to-device copy; a longer input (a large prefill, a decode step of 256 rows) sends its
remainder in a second broadcast. The other ranks loop in `Follower.follow`, making the same call on the same inputs, so
every rank replays the same bucket and meets the same all-reduces. No Ray call happens per step.
Every wait is bounded by the process group's timeout, and an idle rank 0 sends heartbeats so a
follower can tell "idle" from "dead". A model swap or gate runs on every rank the same way:
rank 0 sends each step, and every rank votes (one all-reduce) before a swap is kept or undone.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from workers.model_runner.step_inputs import DecodeInputs, PrefillInputs
from workers.modeling.checkpoint import load_weights
from workers.modeling.lora import AdapterError, load_adapter
from workers.modeling.parallel import TPGroup

if TYPE_CHECKING:
    from workers.graphs.graph_runner import StepRunners

log = logging.getLogger(__name__)

# SWAP_LOAD: load the checkpoint at the path (payload) in place, keeping the old weights aside;
# CHECK_BUCKETS: check every captured bucket against eager (a model gate's step); AGREE: every
# rank votes on what it did since the last vote (rows 1: the vote ends a swap, which each rank
# then keeps or undoes alike); EAGER_PREFILL: a prefill that may not replay graphs.
NOOP, PREFILL, DECODE, EAGER, STOP, LORA_LOAD, SWAP_LOAD, CHECK_BUCKETS, AGREE, EAGER_PREFILL = range(10)
HEADER = 4  # op, rows, payload length, spare
CAPACITY = 1024  # payload ints sent with the header: a decode step of up to 256 rows without page edits fits


def init_tp_group(rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the shards' process group (NCCL on GPU, gloo on CPU); the rank comes from the caller."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
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


def agree(tp: TPGroup, device: torch.device, problem: str | None) -> list[int]:
    """Every rank's vote in one all-reduce: the ranks that had a problem (none: all agree it went well)."""
    failed = torch.zeros(tp.world_size, dtype=torch.int32, device=device)
    failed[tp.rank] = problem is not None
    if tp.world_size > 1:
        dist.all_reduce(failed, group=tp.group)
    return [rank for rank, bad in enumerate(failed.tolist()) if bad]


def load_adapter_shard(runners: StepRunners, slot: int, others: list[int], path: str) -> None:
    """A follower's part of rank 0's adapter load: its shard of the adapter into the same slot, then
    the same verification on the same probe (whose replays and all-reduce pair with rank 0's). A
    shard this rank cannot read fails that verification on every rank; it does not end the rank."""
    model = runners.lora.model
    try:
        model.lora.load(slot, load_adapter(path, path, model.cfg, model.lora.max_rank, model.embed.weight.device))
        problem = None
    except (AdapterError, OSError) as e:
        log.error("tensor-parallel rank %d could not load adapter %s: %s", model.tp.rank, path, e)
        problem = f"rank {model.tp.rank} could not load it: {e}"
    runners.lora.check_adapter(slot, others, problem)


class Follower:
    """A rank > 0: repeats rank 0's model calls on its own shard, and takes its part in rank 0's
    swaps and gates, voting at each AGREE on what went wrong here since the last one."""

    def __init__(self, channel: StepChannel, runners: StepRunners) -> None:
        self.channel = channel
        self.runners = runners
        self.model = runners.base.model
        self.problem: str | None = None  # what went wrong here since the last vote
        self.saved: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] | None = None  # a swap's old weights

    def follow(self) -> None:
        """Until STOP (or a collective times out)."""
        with torch.inference_mode():
            while True:
                op, rows, values = self.channel.recv()
                if op == STOP:
                    return
                if op != NOOP:
                    self._apply(op, rows, values)

    def _apply(self, op: int, rows: int, values: list[int]) -> None:
        if op == LORA_LOAD:  # rows: the slot; values: the other loaded slots' count, them, the path
            others = values[1 : 1 + values[0]]
            load_adapter_shard(self.runners, rows, others, bytes(values[1 + values[0] :]).decode())
        elif op == SWAP_LOAD:
            self._load(bytes(values).decode())
        elif op == CHECK_BUCKETS:
            failed = {b: d for runner in self.runners.all for b, d in runner.check_buckets().items()}
            if failed:
                self.problem = self.problem or f"buckets {sorted(failed)} replay differently from eager"
        elif op == AGREE:
            self._vote(ends_swap=bool(rows))
        elif op in (PREFILL, EAGER_PREFILL):
            batch = PrefillInputs.from_ints(rows, values)
            self.runners.of(batch).prefill(batch, graphs=op == PREFILL)
        else:
            batch = DecodeInputs.from_ints(rows, values)
            runner = self.runners.of(batch)
            (runner.decode if op == DECODE else runner.eager)(batch)

    def _load(self, model_dir: str) -> None:
        """This rank's shard of a checkpoint of the same shapes, into the parameters the graphs read;
        the old weights stay on the host until the swap's last vote."""
        self.saved = [(p, p.data, p.data.to("cpu", copy=True)) for p in self.model.parameters()]
        try:
            load_weights(self.model, model_dir)
        except Exception as e:
            self.problem = f"loading {model_dir}: {e}"
        moved = [p for p, data, _ in self.saved if p.data.data_ptr() != data.data_ptr()]
        if moved:
            self.problem = self.problem or f"{len(moved)} parameter(s) moved to new storage while loading"
        if self.problem:
            log.error("tensor-parallel rank %d: %s", self.tp.rank, self.problem)

    @property
    def tp(self) -> TPGroup:
        return self.channel.tp

    def _vote(self, ends_swap: bool) -> None:
        failed = agree(self.tp, self.channel.device, self.problem)
        self.problem = None
        if not ends_swap or self.saved is None:
            return
        if failed:
            restore_weights(self.saved)
            self.runners.base.cache.clear()
        self.saved = None


def restore_weights(saved: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]]) -> None:
    """Copy weights kept aside back into the storage the graphs read."""
    with torch.no_grad():
        for p, data, old in saved:
            p.data = data
            data.copy_(old)
