"""Tensor-parallel sharding on CPU: two processes over gloo compute what one process computes.

Each rank loads only its share of the checkpoint (column-parallel QKV and gate/up, row-parallel
output and down with an all-reduce, vocab-parallel LM head with an all-gather). The step channel
hands rank 0's inputs to rank 1, which follows; rank 0's logits must equal the unsharded model's.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.kv_pages import page_edits
from tests.unit.conftest import make_hf_checkpoint
from workers.model_runner.step_inputs import DecodeInputs, PrefillInputs
from workers.modeling.checkpoint import load_model
from workers.modeling.lora import load_adapter
from workers.modeling.parallel import TPGroup
from workers.serving.engine import make_runners
from workers.serving.engine_config import EngineConfig
from workers.tensor_parallel.tp import DECODE, PREFILL, STOP, Follower, StepChannel, init_tp_group

STEPS = 32
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [200, 100, 50, 25, 12, 6, 3, 1, 0, 1, 2]]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_greedy(model, send=None, adapters=(0, 0, 0)):
    """Prefill the prompts (slots 0..2, scattered pages, LoRA slots `adapters`), then STEPS greedy
    decode steps; logits of every step."""
    cache = model.make_kv_cache(len(PROMPTS))
    prefill = PrefillInputs(
        [t for p in PROMPTS for t in p],
        [i for p in PROMPTS for i in range(len(p))],
        [s for s, p in enumerate(PROMPTS) for _ in p],
        [a for a, p in zip(adapters, PROMPTS) for _ in p],
        [len(p) for p in PROMPTS],
        page_edits(cache),
    )
    if send:
        send(PREFILL, prefill.rows, prefill.to_ints())
    cache.set_pages(prefill.pages)
    tokens, positions, slots, lora = prefill.to_device(torch.device("cpu"))
    lora = lora if prefill.uses_lora else None
    logits = [model.prefill(tokens, positions, slots, prefill.lens, cache, lora)]
    lengths = list(prefill.lens)
    for _ in range(STEPS):
        batch = DecodeInputs(logits[-1].argmax(-1).tolist(), list(lengths), list(range(len(PROMPTS))), list(adapters))
        if send:
            send(DECODE, batch.rows, batch.to_ints())
        tokens, positions, slots, lora = batch.to_device(torch.device("cpu"))
        logits.append(model.decode(tokens, positions, slots, cache, lora if batch.uses_lora else None))
        lengths = [n + 1 for n in lengths]
    if send:
        send(STOP)
    return torch.stack(logits)


def _rank(rank: int, port: int, path: str, out, adapters: list[str]) -> None:
    torch.set_num_threads(1)
    try:
        _serve_rank(rank, port, path, out, adapters)
    finally:
        torch.distributed.destroy_process_group()
    # Skip interpreter teardown: gloo's threads can abort the process there after a peer has gone,
    # which would turn a finished, correct rank into a spurious SIGABRT.
    out.close()
    out.join_thread()
    os._exit(0)


def _serve_rank(rank: int, port: int, path: str, out, adapters: list[str]) -> None:
    tp = init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=60)
    model = load_model(path, 64, tp=tp)
    load_adapters(model, adapters)
    channel = StepChannel(tp, torch.device("cpu"))
    if rank == 0:
        rows = (1, 0, 2) if adapters else (0, 0, 0)
        out.put(run_greedy(model, channel.send, rows).numpy())  # by value: this process may exit first
        return
    cache = model.make_kv_cache(len(PROMPTS))
    Follower(channel, make_runners(model, cache, EngineConfig())).follow()  # the engine's follower loop


def load_adapters(model, adapters: list[str]) -> None:
    """Adapters into slots 1, 2, ... (each rank reads its own shard of them)."""
    if adapters:
        slots = model.enable_lora(max_loras=len(adapters), max_rank=8)
        for slot, path in enumerate(adapters, 1):
            slots.load(slot, load_adapter(path, path, model.cfg, 8))


def sharded_logits(path, adapters: list[str] = ()) -> torch.Tensor:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(path), out, list(adapters))) for r in range(2)]
    for p in procs:
        p.start()
    result = torch.from_numpy(out.get(timeout=120))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return result


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("llama", {}),  # 4 heads, 2 KV heads: one KV head per rank; vocab 300 splits evenly
        ("llama", {"vocab_size": 301, "tie_word_embeddings": False}),  # odd vocab: padded vocab-parallel head
        ("qwen2", {"num_key_value_heads": 1}),  # QKV bias, and one KV head replicated on both ranks
        ("llama", {"tie_word_embeddings": True}),  # tied: the head is the replicated embedding
    ],
)
def test_tp2_equals_tp1(tmp_path, model_type, extra):
    """Logits of TP=2 equal TP=1 within fp32 tolerance at prefill and every one of 32 greedy
    decode steps, so greedy tokens are identical."""
    make_hf_checkpoint(tmp_path, model_type, seed=3, **extra)
    reference = run_greedy(load_model(tmp_path, 64))
    sharded = sharded_logits(tmp_path)
    torch.testing.assert_close(sharded, reference, rtol=1e-4, atol=1e-5)
    assert torch.equal(sharded.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tp2_with_lora_adapters_equals_tp1(tmp_path, model_type):
    """Two PEFT adapters (all linear layers; attention only, rsLoRA) on rows 0 and 2, none on row 1:
    column-parallel layers hold their rows of B, row-parallel ones their columns of A, and the
    partial deltas ride the layers' own all-reduce. TP=2 equals TP=1 over prefill and 32 steps."""
    from transformers import AutoModelForCausalLM

    from tests.lora_adapters import make_adapter

    make_hf_checkpoint(tmp_path / "base", model_type, seed=3)
    options = [
        dict(r=4, lora_alpha=8, target_modules="all-linear"),
        dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"], use_rslora=True),
    ]
    adapters = []
    for i, option in enumerate(options):
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
        make_adapter(hf, tmp_path / f"adapter{i}", seed=i + 1, **option)
        adapters.append(str(tmp_path / f"adapter{i}"))
    model = load_model(tmp_path / "base", 64)
    load_adapters(model, adapters)
    reference = run_greedy(model, adapters=(1, 0, 2))
    assert not torch.allclose(reference, run_greedy(load_model(tmp_path / "base", 64)), rtol=1e-3)
    sharded = sharded_logits(tmp_path / "base", adapters)
    torch.testing.assert_close(sharded, reference, rtol=1e-4, atol=1e-5)
    assert torch.equal(sharded.argmax(-1), reference.argmax(-1))


def test_kv_heads_that_do_not_divide_are_refused(tmp_path):
    """3 KV heads cannot be spread over 2 ranks (nor replicated evenly): a clear error."""
    make_hf_checkpoint(tmp_path, "llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    with pytest.raises(ValueError, match="num_key_value_heads=3 and tensor_parallel_size=2"):
        load_model(tmp_path, 64, tp=TPGroup(rank=0, world_size=2))
