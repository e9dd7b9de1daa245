"""An in-place swap at tensor_parallel_size 2 on CPU (gloo, two processes) is kept or undone by
every rank together: when rank 1 loads the new checkpoint but reports a problem (here: its read
raises after copying the new weights in), the vote fails the swap on rank 0 too, naming rank 1, and
both ranks put their old shards back. Rank 0 then decodes exactly what it decoded before the swap;
a rank 1 left on the new shard would change every all-reduced sum. A swap every rank agrees on
decodes what a fresh engine on the new checkpoint decodes."""

from __future__ import annotations

import pytest
import torch

import workers.tensor_parallel.tp
from tests.unit.test_tp_startup import start_two_ranks
from workers.front.shard_worker import prepare_follower
from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint
from workers.serving.engine import LLMEngine, load_for_engine
from workers.serving.engine_config import EngineConfig
from workers.serving.model_gate import GateFailed, swap_weights_in_place
from workers.serving.sampling import SamplingParams
from workers.tensor_parallel.tp import Follower, StepChannel, init_tp_group

pytestmark = pytest.mark.timeout(120)
PROMPTS = [[256, 5, 6, 7], [256, 40, 41]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def config(model: str) -> EngineConfig:
    return EngineConfig(model=model, max_num_seqs=4, max_model_len=64, device="cpu")


def decode(engine: LLMEngine) -> list[list[int]]:
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def _swap_twice(rank: int, port: int, paths: dict) -> dict:
    cpu = torch.device("cpu")
    tp = init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", cpu, timeout_s=20)
    model, _, eos, revision = load_for_engine(config(paths["v1"]), cpu, tp)
    channel = StepChannel(tp, cpu)
    if rank == 1:
        real = workers.tensor_parallel.tp.load_weights

        def copies_then_fails(model, model_dir):
            real(model, model_dir)
            if str(model_dir) == paths["v2"]:
                raise OSError(5, "Input/output error (injected on rank 1)")

        workers.tensor_parallel.tp.load_weights = copies_then_fails
        Follower(channel, prepare_follower(model, config(paths["v1"]))).follow()
        return {}
    engine = LLMEngine(model, config(paths["v1"]), eos, revision, channel=channel)
    before = decode(engine)
    try:
        swap_weights_in_place(engine, config(paths["v2"]))
        refused = None
    except GateFailed as e:
        refused = str(e)
    after_refusal = decode(engine)
    swap_weights_in_place(engine, config(paths["v3"]))  # rank 1 reads this one fine
    swapped = decode(engine)
    engine.stop_followers()
    return {"before": before, "refused": refused, "after_refusal": after_refusal, "swapped": swapped}


def test_one_rank_failing_undoes_the_swap_on_every_rank(tmp_path):
    tokenizer = build_byte_tokenizer()
    shape = tiny_hf_config(len(tokenizer))
    paths = {
        name: str(write_checkpoint(tmp_path / name, shape, tokenizer, seed=seed))
        for name, seed in (("v1", 41), ("v2", 42), ("v3", 43))
    }
    results = start_two_ranks(paths, work=_swap_twice)
    rank0 = results[0]
    assert rank0["refused"] is not None and "rank(s) [1]" in rank0["refused"], rank0["refused"]
    assert rank0["after_refusal"] == rank0["before"]
    engine, _ = LLMEngine.from_config(config(paths["v3"]))
    assert rank0["swapped"] == decode(engine) != rank0["before"]
