"""Compile once, capture every bucket (CUDA, the default tiny model in fp32, Triton attention): with
compile on, dynamo compiles the decode step's three parts once whatever the ladder's length (start,
one layer for every layer, end: a graph each for every size, 1 included; a LoRA runner adds a layer
graph per side of its kernels' row limit), every
bucket is captured and reported compiled, replays bit for bit what the compiled step computes and
agrees with the plain eager step on fresh random inputs, and greedy tokens at odd batch sizes equal
the uncompiled engine's. The compile cache lands in its keyed subdirectory."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from policies.graph_policy import GraphPolicy
from policies.lora_slots import LoraLimits
from tests.gpu.test_graph_runner import make_engine, requests, run
from workers.graphs.compile_cache import KEY_FILE
from workers.modeling.lora_kernels import MAX_ROWS
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig

pytestmark = pytest.mark.gpu

NINE = (1, 2, 4, 8, 16, 24, 32, 48, 64)
TWELVE = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)  # past dynamo's default recompile limit of 8


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "models"))
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # an engine with compile_cache_dir sets them
        monkeypatch.delenv(variable, raising=False)


def compiled_engine(buckets: tuple[int, ...], **config) -> LLMEngine:
    """A fresh dynamo (graphs compiled by earlier tests' engines of the same shapes would be reused,
    and not counted), then a compiled engine of `buckets`."""
    torch._dynamo.reset()
    policy = GraphPolicy(decode_batch_buckets=buckets, compile=True, max_cached_graphs=len(buckets))
    engine_config = EngineConfig(
        max_num_seqs=max(buckets), max_model_len=256, device="cuda", attention_backend="triton", graph_policy=policy
    )
    return LLMEngine.from_config(dataclasses.replace(engine_config, **config))[0]


def check_fresh_inputs(engine: LLMEngine, runner) -> None:
    """Every bucket on a probe batch of a seed verification did not use: the replay equals the
    compiled step bit for bit, and the plain eager step (the uncompiled model on the same padded
    inputs) up to inductor's rounding, with the same greedy token wherever eager's top two differ.
    A LoRA runner's rows take turns through slots holding random adapters."""
    with runner.model.lora.random_contents(seed=11) if runner.lora else contextlib.nullcontext():
        for bucket in sorted(runner.table.ready):
            check_bucket(engine, runner, bucket)


@torch.inference_mode()
def check_bucket(engine: LLMEngine, runner, bucket: int) -> None:
    seed = 10_000 + bucket
    batch = runner.probe(bucket, seed)
    assert runner._check(bucket, batch, seed) is None, bucket
    with runner._probe_kv(batch, seed) as reset:
        reset()
        runner.model_runner.load(batch, bucket)
        tokens, positions, slots, adapters = runner.model_runner.views(bucket)
        eager = engine.model.decode(tokens, positions, slots, engine.cache, adapters).float()
        reset()
        replayed = runner._replays[bucket]().float()
    diff = (replayed - eager).abs().max().item()
    assert diff <= 1e-3 * eager.abs().max().item(), (bucket, diff)
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
    assert torch.equal(replayed.argmax(-1)[clear], eager.argmax(-1)[clear]), bucket


@pytest.mark.parametrize("buckets", [NINE, TWELVE], ids=["9-buckets", "12-buckets"])
def test_the_step_compiles_once_whatever_the_ladder(buckets, tmp_path):
    engine = compiled_engine(buckets, compile_cache_dir=str(tmp_path))
    runner = engine.runner
    assert runner.graphs == 3  # the step's start, one layer, its end: every size shares each, 1 included
    status = engine.status()
    assert status.startup["compiled_graphs"] == 3 and status.startup["phases"]["compile"] > 0
    assert runner.table.ready == set(buckets)
    assert all(
        status.buckets[runner.bucket_id(b)]["ready"] and status.buckets[runner.bucket_id(b)]["compiled"]
        for b in buckets
    )
    assert all(r.verify_max_abs_diff == 0.0 for r in runner.records.values())
    check_fresh_inputs(engine, runner)
    (directory,) = tmp_path.iterdir()  # the keyed subdirectory, where inductor wrote what it compiled
    assert (directory / KEY_FILE).exists() and len(list(directory.iterdir())) > 1


def test_compiled_tokens_at_odd_batch_sizes_equal_uncompiled_eager():
    engine = compiled_engine(NINE)
    eager = make_engine(mode="eager", max_num_seqs=64)
    reqs = [  # 13 rows (padded to 16) finish one by one: every size from 13 down to 1
        (prompt, dataclasses.replace(params, max_tokens=8 + 2 * i))
        for i, (prompt, params) in enumerate(requests(13, seed=31, sampled=False))
    ]
    assert run(engine, reqs).outputs == run(eager, reqs).outputs


def test_lora_runner_adds_a_graph_per_side_of_the_kernel_row_limit():
    buckets = (1, 2, 8, MAX_ROWS, 2 * MAX_ROWS)
    engine = compiled_engine(buckets, lora=LoraLimits(max_loras=2, max_lora_rank=8))
    assert engine.runner.graphs == 3
    # its layer, sizes up to MAX_ROWS (kernels) and sizes above (matmul form); start and end are shared
    assert engine.runners.lora.graphs == 2
    assert engine.runners.lora.table.ready == set(buckets) and engine.status().startup["compiled_graphs"] == 5
    check_fresh_inputs(engine, engine.runners.lora)
