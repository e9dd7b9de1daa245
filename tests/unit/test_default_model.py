"""The embedded tiny default model: written once per cache dir, deterministic, a real HF checkpoint
with a working byte-level tokenizer and chat template."""

from __future__ import annotations

import json
import os

import pytest
import torch

from workers.modeling.checkpoint import load_model
from workers.modeling.checkpoint_dir import CheckpointError, load_tokenizer
from workers.modeling.default_model import TINY_NAME, default_model_dir

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces, tabs\tand\nnewlines  ",
    "naïve café, Straße, Ærø",
    "Привет, мир! こんにちは世界 你好 مرحبا بالعالم नमस्ते",
    "emoji: 🙂🚀👩‍💻 🇺🇦 and a flag",
    "",
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(path))
    return path


def test_written_into_the_cache_dir(cache):
    """default_model_dir() writes config, weights and tokenizer under $GRAPHSERVE_CACHE, leaving no
    temporary directory behind."""
    d = default_model_dir()
    assert d == cache / TINY_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (d / name).is_file(), name
    assert [p.name for p in cache.iterdir()] == [TINY_NAME]


def test_second_call_reuses_without_rewriting(cache):
    """A second call returns the same directory and leaves the files as they are."""
    d = default_model_dir()
    files = [d / "config.json", d / "model.safetensors", d / "tokenizer.json"]
    for f in files:
        os.utime(f, ns=(1_000_000_000, 1_000_000_000))  # an old mtime any rewrite would change
    assert default_model_dir() == d
    for f in files:
        assert f.stat().st_mtime_ns == 1_000_000_000, f.name
    assert [p.name for p in cache.iterdir()] == [TINY_NAME]


def test_deterministic_across_cache_dirs(tmp_path, monkeypatch):
    """Two fresh cache dirs get byte-identical weights and config (replicas that race must agree)."""
    dirs = []
    for name in ("a", "b"):
        monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path / name))
        dirs.append(default_model_dir())
    assert dirs[0] != dirs[1]
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes(), name


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_tokenizer_round_trips_unicode_and_adds_bos(cache, text):
    """Any text (non-Latin scripts, emoji, whitespace) encodes to in-vocab ids starting with BOS and
    decodes back exactly."""
    d = default_model_dir()
    tok = load_tokenizer(d)
    vocab_size = json.loads((d / "config.json").read_text())["vocab_size"]
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    assert all(0 <= i < vocab_size for i in ids)
    assert len(ids) == 1 + len(text.encode("utf-8"))  # one token per byte
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_special_token_ids_match_config(cache):
    """config.json's bos/eos ids are the tokenizer's <s> and </s>, and the vocab covers them."""
    d = default_model_dir()
    tok = load_tokenizer(d)
    cfg = load_model(d, max_model_len=16).cfg
    assert cfg.bos_token_id == tok.bos_token_id == tok.convert_tokens_to_ids("<s>")
    assert cfg.eos_token_ids == (tok.eos_token_id,) and tok.eos_token == "</s>"
    assert cfg.vocab_size == len(tok)


def test_chat_template_with_generation_prompt(cache):
    """apply_chat_template renders each turn and, with add_generation_prompt, ends with the
    assistant tag as a single special token."""
    tok = load_tokenizer(default_model_dir())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>Be brief.</s><|user|>Hi 🙂</s><|assistant|>"
    without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == "<|system|>Be brief.</s><|user|>Hi 🙂</s>"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert ids[0] == tok.convert_tokens_to_ids("<|system|>")
    assert tok.decode(ids) == text


@torch.no_grad()
def test_transformers_loads_it_and_agrees(cache):
    """transformers' LlamaForCausalLM loads the directory as is, and its logits equal ours: the
    default model is a real checkpoint, not something only our loader understands."""
    from transformers import LlamaForCausalLM

    d = default_model_dir()
    hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = load_model(d, max_model_len=64)
    ids = torch.tensor(load_tokenizer(d).encode("The tiny model says: héllo 🙂"))
    n = ids.numel()

    ref = hf(input_ids=ids[None]).logits[0, -1]
    got = ours.prefill(ids, torch.arange(n), torch.zeros(n, dtype=torch.long), [n], ours.make_kv_cache(1))[0]
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-4
    assert got.argmax() == ref.argmax()


@pytest.mark.parametrize("where", ["/proc/graphserve-cache", "a-file/cache"])
def test_a_cache_that_cannot_be_created_names_the_variable(tmp_path, monkeypatch, where):
    """GRAPHSERVE_CACHE=/proc/nope failed every replica start with a bare FileNotFoundError from
    mkdir, naming neither the cache nor the variable."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRAPHSERVE_CACHE", where)
    monkeypatch.setenv("GRAPHSERVE_DEFAULT_MODEL", "tiny")
    with pytest.raises(CheckpointError, match=f"model cache {where} cannot be created .*set GRAPHSERVE_CACHE"):
        default_model_dir()
