"""The step channel on CPU: two processes over gloo; rank 1 receives exactly what rank 0 sent,
whether the payload is empty, fits in the one fixed-size broadcast, or spills past CAPACITY, and
only a payload longer than CAPACITY costs a second broadcast."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workers.tensor_parallel.tp import CAPACITY, DECODE, NOOP, PREFILL, STOP, StepChannel, init_tp_group

MESSAGES = [
    (DECODE, 3, [5, 17, 42, 7, 8, 9, 0, 1, 2]),
    (NOOP, 0, []),
    (PREFILL, 2, list(range(CAPACITY + 500))),  # longer than CAPACITY: a second broadcast
    (DECODE, 1, [-3, 2**40, 1]),  # after the spill, back to one broadcast; stale ints must not leak
    (PREFILL, 4, list(range(CAPACITY, 0, -1))),  # exactly CAPACITY
    (STOP, 0, []),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    try:
        tp = init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=60)
        _exchange(rank, StepChannel(tp, torch.device("cpu")), out)
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: gloo's threads can abort the process there after a peer has gone.
    out.close()
    out.join_thread()
    os._exit(0)


def _exchange(rank: int, channel: StepChannel, out) -> None:
    """Rank 0 sends MESSAGES; rank 1 reports what it received and how many broadcasts each took."""
    if rank == 0:
        for op, rows, values in MESSAGES:
            channel.send(op, rows, values)
        return
    broadcast, calls = dist.broadcast, []
    dist.broadcast = lambda *args, **kwargs: calls.append(1) or broadcast(*args, **kwargs)
    received, counts = [], []
    for _ in MESSAGES:
        received.append(channel.recv())
        counts.append(len(calls))
        calls.clear()
    out.put((received, counts))


def test_follower_receives_exactly_what_rank0_sent():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    received, broadcasts = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert received == MESSAGES
    assert broadcasts == [2 if len(values) > CAPACITY else 1 for _, _, values in MESSAGES]
