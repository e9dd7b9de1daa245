"""The model gate and the in-place swap of weights, on real checkpoints of the tiny shape: new weights
decode what an engine started on them decodes, NaN weights fail the eager probe and leave the old
model serving bit for bit, a checkpoint of another shape is not swapped in place, and an
operator's prompts file must decode to its completions."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from safetensors.torch import load_file, save_file

from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.model_gate import GateFailed, run_gate, same_shapes, swap_weights_in_place
from workers.serving.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 3, 9, 200, 17]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gate")
    tokenizer = build_byte_tokenizer()
    shape = tiny_hf_config(len(tokenizer))
    old = write_checkpoint(tmp / "old", shape, tokenizer, seed=1)
    new = write_checkpoint(tmp / "new", shape, tokenizer, seed=2)
    nan = write_checkpoint(tmp / "nan", shape, tokenizer, seed=3)
    state = load_file(nan / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.weight"][:, 0] = math.nan  # NaN reaches layer 1's KV
    save_file(state, nan / "model.safetensors", metadata={"format": "pt"})
    wide = write_checkpoint(tmp / "wide", {**shape, "hidden_size": 128, "intermediate_size": 256}, tokenizer, seed=4)
    return {"old": old, "new": new, "nan": nan, "wide": wide}


def engine_on(path) -> tuple[LLMEngine, object]:
    return LLMEngine.from_config(EngineConfig(model=str(path), max_num_seqs=4, max_model_len=128))


def swapped(engine: LLMEngine, path, revision: str | None = None) -> EngineConfig:
    return dataclasses.replace(engine.config, model=str(path), model_revision=revision)


def greedy(engine: LLMEngine) -> list[list[int]]:
    seqs = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def test_new_weights_in_place_decode_what_a_fresh_engine_decodes(checkpoints):
    engine, _ = engine_on(checkpoints["old"])
    before, old_revision = greedy(engine), engine.revision
    weight = engine.model.embed.weight
    address = weight.data_ptr()
    _, report = swap_weights_in_place(engine, swapped(engine, checkpoints["new"], "v2"))
    assert weight.data_ptr() == address and engine.model.embed.weight is weight  # the same storage
    fresh, _ = engine_on(checkpoints["new"])
    after = greedy(engine)
    assert after == greedy(fresh) and after != before
    assert engine.revision == "v2" != old_revision and report["golden_prompts"] == 4
    assert engine.stats.snapshot()["decode_step_parts"][0]["model_revision"] == "v2"


def test_nan_weights_fail_the_gate_and_the_old_model_serves_on(checkpoints):
    engine, _ = engine_on(checkpoints["old"])
    before, revision = greedy(engine), engine.revision
    with pytest.raises(GateFailed, match="not finite"):
        swap_weights_in_place(engine, swapped(engine, checkpoints["nan"]))
    assert greedy(engine) == before and engine.revision == revision


def test_only_a_checkpoint_of_the_same_shapes_swaps_in_place(checkpoints):
    assert same_shapes(checkpoints["old"], checkpoints["new"])
    assert not same_shapes(checkpoints["old"], checkpoints["wide"])


def test_a_swap_from_or_to_the_default_model_loads_in_place_when_the_shapes_match(checkpoints, tmp_path, monkeypatch):
    """The default model (`model` unset) was never compared: a swap from it to a fine-tune of the
    same shapes rebuilt the engine (a new process, every graph captured again)."""
    from app.shards import _in_place

    monkeypatch.setenv("GRAPHSERVE_DEFAULT_MODEL", "tiny")
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    default, new = EngineConfig(model=None), EngineConfig(model=str(checkpoints["new"]))
    assert _in_place(default, new) and _in_place(new, default)
    assert not _in_place(default, EngineConfig(model=str(checkpoints["wide"])))
    assert not _in_place(default, dataclasses.replace(new, max_model_len=64))  # another setting: a rebuild


def test_the_operators_prompts_must_decode_to_their_completions(checkpoints, tmp_path):
    engine, tokenizer = engine_on(checkpoints["new"])
    params = SamplingParams(max_tokens=6, temperature=0.0)
    seq = engine.add_request(tokenizer("Hello")["input_ids"], params)
    while engine.has_work():
        engine.step()
    completion = tokenizer.decode([t for t in seq.output_ids if t not in engine.eos_token_ids])
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "Hello", "completion": completion, "max_tokens": 6}) + "\n")
    assert run_gate(engine, tokenizer, str(good))["operator_prompts"] == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Hello", "completion": completion + "x", "max_tokens": 6}) + "\n")
    with pytest.raises(GateFailed, match="line 1: expected"):
        run_gate(engine, tokenizer, str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(GateFailed, match="gate_prompts_file"):
        run_gate(engine, tokenizer, str(bad))


def test_a_parameter_moved_while_loading_fails_and_is_put_back(checkpoints, monkeypatch):
    """Graphs read fixed addresses: a load that replaces a parameter's storage instead of writing
    into it would leave them reading the old weights. The swap refuses it and points it back."""
    from workers.serving import model_gate

    engine, _ = engine_on(checkpoints["old"])
    before = greedy(engine)
    params = dict(engine.model.named_parameters())
    name = next(n for n in params if n.endswith("weight") and params[n].dim() == 2)
    address = params[name].data_ptr()
    load = model_gate.load_weights

    def load_then_move(model, model_dir):
        load(model, model_dir)
        dict(model.named_parameters())[name].data = dict(model.named_parameters())[name].data.clone()

    monkeypatch.setattr(model_gate, "load_weights", load_then_move)
    with pytest.raises(GateFailed, match="moved to new storage"):
        swap_weights_in_place(engine, swapped(engine, checkpoints["new"]))
    assert dict(engine.model.named_parameters())[name].data_ptr() == address and greedy(engine) == before
