"""response_format on a real GPU: the masks go through pinned host memory and are applied after the
replayed graph, which stays as it was captured (rows under a schema replay like any other); a
mixed batch gives its free rows exactly the tokens of a batch without schemas, and the constrained
rows what the CPU draws for them (tiny default model, fp32). Below the engine: the mask kernel bans
on CUDA what the torch ops ban on CPU, and the mask buffers, reused step after step with their copy
on a stream of its own, give each step its own masks."""

import concurrent.futures
import json

import pytest
import torch

from policies.graph_policy import GraphPolicy
from tests.unit.test_token_mask import SHAPES, random_case
from workers.front.async_engine import apply_contained
from workers.protocol import Call
from workers.serving import token_mask
from workers.serving.batch_sampler import BitmaskBuffers
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.json_schema import canonical_schema
from workers.serving.sampling import SamplingParams
from workers.serving.sampling_ops import apply_token_bitmask

pytestmark = pytest.mark.gpu
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["kind", "n"],
    "additionalProperties": False,
}


def requests(constrained: bool) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        prompt = torch.randint(0, 256, (5 + 3 * i,), generator=g).tolist()
        schema = canonical_schema(SCHEMA) if constrained and i % 2 else None
        sampling = dict(temperature=0.0) if i % 4 < 2 else dict(temperature=0.9, top_p=0.9, seed=100 + i)
        out.append((prompt, SamplingParams(max_tokens=30, ignore_eos=schema is None, json_schema=schema, **sampling)))
    return out


def run(device: str, batch: list[tuple[list[int], SamplingParams]]) -> tuple[list, dict, object]:
    config = EngineConfig(max_num_seqs=8, max_model_len=128, device=device, graph_policy=GraphPolicy(compile=False))
    engine, tokenizer = LLMEngine.from_config(config)
    seqs = [engine.add_request(p, params) for p, params in batch]
    while engine.has_work():
        engine.step()
    return [(s.output_ids, s.finish_reason) for s in seqs], engine.stats.snapshot(), tokenizer


def test_a_mixed_batch_replays_its_graph_and_leaves_free_rows_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    free, _, _ = run("cuda", requests(False))
    mixed, stats, tokenizer = run("cuda", requests(True))
    on_cpu, _, _ = run("cpu", requests(True))
    for i, ((ids, reason), (free_ids, free_reason)) in enumerate(zip(mixed, free)):
        if i % 2:
            document = json.loads(tokenizer.decode(ids))
            assert set(document) == {"kind", "n"} and document["kind"] in ("cat", "dog") and 0 <= document["n"] <= 99
            assert reason == "stop"
        else:
            assert (ids, reason) == (free_ids, free_reason)
    assert mixed == on_cpu
    modes = {p["execution_mode"] for p in stats["decode_step_parts"]}
    assert modes == {"cuda_graph"}, stats["decode_step_parts"]


def test_every_row_constrained_is_drawn_after_its_masks_fill_and_draws_what_the_cpu_draws(tmp_path, monkeypatch):
    """Twelve rows, each under a schema: their masks are filled ahead, and each replayed step is
    left undrawn until the next one (async scheduling). Between two steps a call replays every
    captured graph, which writes the logits such a step holds: the step is drawn before it runs,
    and the tokens are those the CPU draws."""
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    g = torch.Generator().manual_seed(1)
    batch = [
        (
            torch.randint(0, 256, (4 + i,), generator=g).tolist(),
            SamplingParams(max_tokens=30, json_schema=canonical_schema(SCHEMA), temperature=0.8, seed=i),
        )
        for i in range(12)
    ]
    outputs = {}
    for device in ("cuda", "cpu"):
        config = EngineConfig(
            max_num_seqs=12, max_model_len=128, device=device, graph_policy=GraphPolicy(compile=False)
        )
        engine, _ = LLMEngine.from_config(config)
        seqs = [engine.add_request(p, params) for p, params in batch]
        undrawn, replayed = 0, None
        while engine.has_work():
            engine.step()
            if engine._in_flight is not None and engine._in_flight.draw is None:
                undrawn += 1
                if device == "cuda" and replayed is None:
                    replayed = concurrent.futures.Future()
                    apply_contained(engine, Call(lambda e: [r.check_buckets() for r in e.runners.all], replayed))
        outputs[device] = [(s.output_ids, s.finish_reason) for s in seqs]
        if device == "cuda":
            assert undrawn > 5 and replayed.result() == [{}] * len(engine.runners.all)
            modes = {p["execution_mode"] for p in engine.stats.snapshot()["decode_step_parts"]}
            assert modes == {"cuda_graph"}
    assert outputs["cuda"] == outputs["cpu"]


@pytest.mark.parametrize(("width", "words"), [*SHAPES, (128256, 1536), (49152, 4008)])
def test_the_kernel_bans_on_cuda_what_the_torch_ops_ban_on_cpu(width, words):
    """(128256, 1536): the 1B shape's logits under SmolLM2's 49152 tokens, the columns past them banned."""
    logits, rows, bitmask = random_case(width, words, seed=width + words)
    on_cpu = apply_token_bitmask(logits.clone(), torch.tensor(rows), bitmask)
    on_gpu = logits.cuda()
    assert token_mask.available(on_gpu)
    apply_token_bitmask(on_gpu, torch.tensor(rows, device="cuda"), bitmask.cuda())
    assert torch.equal(on_gpu.cpu(), on_cpu)
    masks = torch.tensor([2, 0, 1])  # bitmask rows picked by index, as the sampler's rows by slot
    on_cpu = apply_token_bitmask(logits.clone(), torch.tensor(rows), bitmask, masks)
    on_gpu = logits.cuda()
    apply_token_bitmask(on_gpu, torch.tensor(rows, device="cuda"), bitmask.cuda(), masks.cuda())
    assert torch.equal(on_gpu.cpu(), on_cpu)


def test_the_mask_buffers_reused_step_after_step_give_each_step_its_own_masks():
    """No host sync between steps, and each step's launch queued behind slow matmuls: a copy that
    overwrote the device buffer before the last launch read it, or a fill that overwrote the host
    buffer under a copy still pending, would give some step another step's masks. Each row's
    bitmask goes to a slot's row of the buffer, as the sampler's fills do."""
    device = torch.device("cuda")
    slots, words, width = 16, 4008, 128256
    buffers = BitmaskBuffers(slots, words, device)
    g = torch.Generator().manual_seed(0)
    slow = torch.randn(4096, 4096, device=device)
    steps = []
    for step in range(24):
        rows = torch.randperm(slots, generator=g)[: 1 + step % slots].tolist()
        at = torch.randperm(slots, generator=g)[: len(rows)].tolist()  # their bitmask rows (slots)
        bitmask = torch.randint(-(2**31), 2**31, (len(rows), words), dtype=torch.int32, generator=g)
        buffers.writable()
        buffers.masks[at] = bitmask
        buffers.stage(rows, at)
        buffers.send()
        logits = torch.randn(slots, width, device=device)
        before = logits.clone()
        for _ in range(4):
            torch.mm(slow, slow)
        buffers.apply(logits)
        steps.append((before, rows, bitmask, logits))
    for before, rows, bitmask, logits in steps:
        assert torch.equal(logits.cpu(), apply_token_bitmask(before.cpu(), torch.tensor(rows), bitmask))


def test_new_mask_buffers_wait_for_the_work_still_writing_their_memory():
    """The caching allocator gives the buffers the memory of a tensor freed while a kernel queued
    on the main stream still writes it. Their first copy, on a stream of its own, must land after
    that kernel: run ahead of it, every row's mask would be the kernel's bits (here: all tokens
    allowed), as a batch's first tokens under a schema were on an H100
    (bench/results/structured_output_mask_fault_h100.log)."""
    device = torch.device("cuda")
    slots, words = 16, 4008
    layout = BitmaskBuffers(slots, words, torch.device("cpu"))  # the buffers' size, and where their rows start
    previous = torch.empty_like(layout.on_host, device=device)
    torch.cuda._sleep(200_000_000)  # the main stream is busy ...
    previous[layout.masks.storage_offset() :].fill_(-1)  # ... before this write into what becomes the bitmask rows
    address = previous.data_ptr()
    del previous
    buffers = BitmaskBuffers(slots, words, device)
    assert buffers.on_device.data_ptr() == address, "the allocator did not reuse the freed block: no race to test"
    buffers.writable()
    buffers.masks.zero_()
    buffers.masks[:, 0] = 1  # token 0 alone allowed in every row
    buffers.stage(list(range(slots)), list(range(slots)))
    buffers.send()
    logits = torch.randn(slots, words * 32, device=device)
    buffers.apply(logits)
    assert torch.isneginf(logits[:, 1:]).all().item()
    assert torch.isfinite(logits[:, 0]).all().item()
