"""The vocabulary's slices (`grammar.SLICES`) only make masks cheaper: with SmolLM2's tokenizer, a
mask is the same bit for bit as with llguidance's default slices, at every count of characters left
in strings bounded at 12 to 80 and at every token of the benchmark schemas' documents."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch
from transformers import AutoTokenizer

from bench.json_schemas import DOCUMENTS
from tests.smollm2 import smollm2_cache
from workers.modeling.default_model import smollm2_file
from workers.modeling.gguf import converted
from workers.serving.grammar import SLICES, GrammarCompiler
from workers.serving.grammar_tokenizer import tokenizer_json
from workers.serving.json_schema import canonical_schema, grammar_of

WORDS = "the quick brown fox jumps over the lazy dog " * 3


def bounded(max_length: int) -> dict:
    name = {"type": "string", "maxLength": max_length}
    return {"type": "object", "properties": {"name": name}, "required": ["name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(converted(smollm2_file(), smollm2_cache(tmp_path_factory)))


@pytest.fixture(scope="module")
def compilers(tokenizer):
    """graphserve's compiler, and llguidance's default slicing of the same vocabulary."""
    compiler = GrammarCompiler(tokenizer, (tokenizer.eos_token_id,), len(tokenizer))
    general = llguidance.LLTokenizer(
        tokenizer_json(tokenizer), n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id]
    )
    yield compiler, general
    compiler.close()


def documents(tokenizer) -> list[tuple[dict, list[int]]]:
    """Schema and token ids: names at their bound in words and one character a token, and the
    benchmark schemas' documents."""
    out = []
    one = tokenizer.convert_tokens_to_ids("a")
    for n in (12, 24, 32, 80):
        head = tokenizer('{"name": "', add_special_tokens=False)["input_ids"]
        tail = tokenizer('"}', add_special_tokens=False)["input_ids"]
        out.append((bounded(n), head + tokenizer(WORDS[:n], add_special_tokens=False)["input_ids"] + tail))
        out.append((bounded(n), head + [one] * n + tail))
    for schema, document in DOCUMENTS.values():
        out.append((schema, tokenizer(json.dumps(document), add_special_tokens=False)["input_ids"]))
    return out


def test_the_slices_keep_llguidances_own():
    assert set(llguidance.LLTokenizer.general_slices()) <= set(SLICES)


def test_every_mask_is_the_same_as_with_llguidances_slices(tokenizer, compilers):
    compiler, general = compilers
    words = compiler.mask_words
    masks = 0
    for schema, ids in documents(tokenizer):
        text = canonical_schema(schema)
        ours = compiler.grammar(compiler.compile(text).result()).matcher
        theirs = llguidance.LLMatcher(general, grammar_of(text), log_level=0)
        for token in ids:
            a, b = torch.zeros(words, dtype=torch.int32), torch.zeros(words, dtype=torch.int32)
            ours.unsafe_compute_mask_ptr(a.data_ptr(), words * 4)
            theirs.unsafe_compute_mask_ptr(b.data_ptr(), words * 4)
            assert torch.equal(a, b), f"{text}: before {tokenizer.decode([token])!r}"
            assert ours.consume_token(token) and theirs.consume_token(token)
            masks += 1
        assert ours.is_accepting() and theirs.is_accepting()
    assert masks > 400
