"""Tensor-parallel start-up on CPU (gloo, two processes) degrades instead of hanging: a bucket that
fails to capture on rank 1 only, and one that fails verification on rank 1 only, run eager on both
ranks; every other bucket replays on both, in lockstep.

Capture is the CPU stand-in of `graph_faults.EagerGraphRunner` (eager-backed replays, so verifying
a bucket really runs its all-reduces over gloo), put in place of GraphRunner for the real start-up
paths: rank 0 is an LLMEngine with a step channel, rank 1 runs `prepare_follower` and then follows.
Verifying before the ranks agree pairs rank 0's all-reduces for the bucket rank 1 lacks with rank
1's for the next one: an error or a hang, which the short collective timeout ends.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from multiprocessing.connection import wait

import pytest
import torch
import torch.multiprocessing as mp

import workers.front.shard_worker
import workers.serving.engine
from policies.graph_policy import GraphPolicy
from tests.unit.graph_faults import EagerGraphRunner, nan_at_argmax
from workers.graphs.compiled_step import CompiledStep, graphs_compiled
from workers.modeling.default_model import default_model_dir
from workers.serving.engine import LLMEngine, load_for_engine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams
from workers.tensor_parallel.tp import Follower, StepChannel, init_tp_group

pytestmark = pytest.mark.timeout(90)
BUCKETS = (1, 2, 4, 8)
CAPTURE_FAILS, VERIFY_FAILS = 2, 4  # on rank 1 only
TIMEOUT_S = 15  # the collective timeout: a start-up that hangs ends within it
BATCH_SIZES = (1, 2, 4, 8)  # one batch per bucket, each of DECODE_STEPS decode steps
DECODE_STEPS = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(work, rank: int, port: int, arg, conn) -> None:
    """One rank's process: work(rank, port, arg)'s result (or its error) to the test."""
    torch.set_num_threads(1)
    try:
        conn.send(work(rank, port, arg))
    except BaseException as e:  # reported to the test, which fails with it
        conn.send(f"{type(e).__name__}: {e}")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # Skip interpreter teardown: gloo's threads can abort the process there after a peer has gone.
    conn.close()
    os._exit(0)


def _start_and_serve(rank: int, port: int, model_dir: str) -> dict:
    """Start this rank as serving does, with the stand-in runner; rank 0 then decodes one batch per
    bucket (rank 1 following) and stops rank 1. Returns this rank's buckets and replay counts."""
    cpu = torch.device("cpu")
    config = EngineConfig(
        model=model_dir,
        max_num_seqs=max(BATCH_SIZES),
        max_model_len=64,
        device="cpu",
        graph_policy=GraphPolicy(decode_batch_buckets=BUCKETS),
    )
    tp = init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", cpu, timeout_s=TIMEOUT_S)
    model, _, eos, revision = load_for_engine(config, cpu, tp)
    if rank == 1:
        faults, fail = {VERIFY_FAILS: nan_at_argmax(model)}, frozenset({CAPTURE_FAILS})
    else:
        faults, fail = {}, frozenset()
    stand_in = functools.partial(EagerGraphRunner, faults=faults, fail=fail)
    workers.serving.engine.GraphRunner = stand_in  # this process only
    channel = StepChannel(tp, cpu)
    if rank == 1:
        runners = workers.front.shard_worker.prepare_follower(model, config)
        Follower(channel, runners).follow()
        return {"report": runners.base.report(), "replayed": dict(runners.base.replayed)}
    engine = LLMEngine(model, config, eos, revision, channel=channel)
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    for n in BATCH_SIZES:
        seqs = [engine.add_request([256, i + 1, 7], params) for i in range(n)]
        while engine.has_work():
            engine.step()
        assert all(len(s.output_ids) == DECODE_STEPS + 1 for s in seqs)
    engine.stop_followers()
    parts = engine.stats.snapshot()["decode_step_parts"]
    parts = {(p["execution_mode"], p["bucket_id"], p["fallback_reason"]) for p in parts}
    return {"report": engine.runner.report(), "replayed": dict(engine.runner.replayed), "parts": parts}


def _compiled_against_eager(rank: int, port: int, model_dir: str) -> dict:
    """This rank's shard in fp32, its decode step compiled by layer (inductor's C++ backend; an
    all-reduce inside every layer graph) against its plain eager step, on the same fresh random
    inputs and KV on both ranks, at 8, 3 and 1 rows."""
    cpu = torch.device("cpu")
    config = EngineConfig(model=model_dir, max_num_seqs=8, max_model_len=64, device="cpu", dtype="float32")
    tp = init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", cpu, timeout_s=TIMEOUT_S)
    model, _, _, _ = load_for_engine(config, cpu, tp)
    cache, step = model.make_kv_cache(8), CompiledStep(model)
    generator = torch.Generator().manual_seed(0)
    differences, sums = {}, {}
    with torch.inference_mode():
        for rows in (8, 3, 1):
            tokens = torch.randint(0, 256, (rows,), generator=generator)
            positions = torch.randint(0, 64, (rows,), generator=generator)
            slots = torch.randperm(8, generator=generator)[:rows]
            cache.k.normal_(generator=generator)
            cache.v.normal_(generator=generator)
            eager = model.decode(tokens, positions, slots, cache)
            compiled = step(tokens, positions, slots, cache)
            differences[rows] = ((compiled - eager).abs().max() / eager.abs().max()).item()
            sums[rows] = compiled.double().sum().item()
    return {"differences": differences, "sums": sums, "graphs": graphs_compiled()}


def test_the_step_compiled_by_layer_equals_eager_on_both_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    results = start_two_ranks(str(default_model_dir()), work=_compiled_against_eager)
    for rank in (0, 1):
        assert results[rank]["graphs"] == 3, rank  # start, layer, end: every row count and layer shares each
        assert all(d < 1e-5 for d in results[rank]["differences"].values()), results[rank]["differences"]
    assert results[0]["sums"] == results[1]["sums"]  # the logits are gathered whole on every rank


def rank_engine(rank: int, port: int, cfg: EngineConfig) -> LLMEngine | None:
    """In a rank's process: join the two-rank gloo group and load cfg's shard. Rank 1 follows
    rank 0's steps until told to stop, then gets None; rank 0 gets the engine that leads them."""
    cpu = torch.device("cpu")
    tp = init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", cpu, timeout_s=15)
    model, _, eos, revision = load_for_engine(cfg, cpu, tp)
    channel = StepChannel(tp, cpu)
    if rank == 1:
        Follower(channel, workers.front.shard_worker.prepare_follower(model, cfg)).follow()
        return None
    return LLMEngine(model, cfg, eos, revision, channel=channel)


def start_two_ranks(arg, work=_start_and_serve) -> dict[int, dict]:
    """Both ranks' results of work(rank, port, arg) (default: start up and serve); the test fails
    with a rank's error, as soon as a rank dies (gloo aborts a process on a collective mismatch), or
    when the deadline passes."""
    ctx = mp.get_context("spawn")
    port = _port()
    pending, procs = {}, []
    for rank in range(2):
        receive, send = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_rank, args=(work, rank, port, arg, send)))
        procs[-1].start()
        send.close()  # the child holds the only sending end: its death reads as end of file
        pending[receive] = rank
    deadline = time.monotonic() + 2 * TIMEOUT_S + 30  # start-up of two interpreters, then the work
    results: dict[int, dict | str] = {}
    try:
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            assert ready, f"no result from ranks {sorted(pending.values())} within the deadline"
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    results[rank] = conn.recv()
                except EOFError:
                    procs[rank].join(timeout=max(0.0, deadline - time.monotonic()))
                    results[rank] = f"rank {rank} died (exit code {procs[rank].exitcode}) before reporting"
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    errors = {r: v for r, v in results.items() if isinstance(v, str)}
    assert not errors, f"tensor-parallel start-up failed: {errors}"
    return results


def test_a_bucket_lost_on_one_rank_runs_eager_on_both(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    results = start_two_ranks(str(default_model_dir()))
    ready = {b for b in BUCKETS if b not in (CAPTURE_FAILS, VERIFY_FAILS)}
    for rank in (0, 1):
        report = results[rank]["report"]
        assert {b for b in BUCKETS if report[f"decode_bs_{b}"]["ready"]} == ready, rank
        assert report[f"decode_bs_{CAPTURE_FAILS}"]["fallback_reason"] == "capture_error"
        assert report[f"decode_bs_{VERIFY_FAILS}"]["fallback_reason"] == "verify_mismatch"
        # Each ready bucket replayed once in verification and at every decode step; the bucket that
        # failed verification replayed only there; the one lost at capture never on either rank.
        # The two 3-token prompts' prefill ran as 6 rows of the decode step, on bucket 8 on both
        # ranks (the others: 3 tokens on bucket 4, which runs eager; 12 and 24, above the ladder).
        expected = {b: 1 + DECODE_STEPS for b in ready} | {VERIFY_FAILS: 1}
        expected[8] += 1
        assert results[rank]["replayed"] == expected, rank
    # Each rank says where the bucket was lost.
    own, other = results[1]["report"], results[0]["report"]
    assert "injected capture failure" in own[f"decode_bs_{CAPTURE_FAILS}"]["error"]
    assert "non-finite" in own[f"decode_bs_{VERIFY_FAILS}"]["error"]
    for bucket in (CAPTURE_FAILS, VERIFY_FAILS):
        assert "on another tensor-parallel rank" in other[f"decode_bs_{bucket}"]["error"]
    assert results[0]["parts"] == {
        ("cuda_graph", "decode_bs_1", "none"),
        ("eager", "none", "capture_error"),
        ("eager", "none", "verify_mismatch"),
        ("cuda_graph", "decode_bs_8", "none"),
    }


def test_a_rank_failure_reads_as_one_line_without_ray_internals():
    """A rank whose start failed put Ray's whole creation-task traceback (colour codes, actor id,
    pid, address; ~2 KB) into the swap's reason, /admin/model and the audit log; a rank that died
    put its actor id, pid and address into the 503 a client got. The log keeps the rest."""
    from app.shards import one_line

    failed_start = RuntimeError(
        "The actor died because of an error raised in its creation task, \x1b[36mray::ShardWorker.__init__()"
        "\x1b[39m (pid=6500, ip=192.0.2.2, actor_id=a1b2)\n"
        '  File "/srv/workers/front/shard_worker.py", line 49, in __init__\n    engine = LLMEngine(...)\n'
        "ValueError: num_attention_heads=9 is not divisible by tensor_parallel_size=2"
    )
    assert one_line(failed_start) == "ValueError: num_attention_heads=9 is not divisible by tensor_parallel_size=2"
    died = RuntimeError(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: ShardWorker\n\tactor_id: b534f8\n"
        "\tpid: 10039\n\tnamespace: serve\n\tip: 192.0.2.2"
    )
    assert one_line(died) == "The actor died unexpectedly before finishing this task."
