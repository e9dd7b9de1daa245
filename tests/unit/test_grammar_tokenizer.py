"""The grammar reads each token as the model's tokenizer decodes it. SmolLM2 converted from its GGUF
file by transformers 5.17 has a byte-level vocabulary under a SentencePiece-style decoder, which
llguidance read as SentencePiece (32,888 tokens with other bytes; a mask allowed `:` where the
grammar forced a space): read as byte-level now. A tokenizer llguidance still misreads, or
cannot read, gets a 400 saying so instead of wrong masks."""

from __future__ import annotations

import json
import shutil

import llguidance
import llguidance.numpy
import pytest
from transformers import AutoTokenizer

from tests import tokenizer_kinds
from tests.smollm2 import smollm2_cache
from workers.modeling.default_model import smollm2_file
from workers.modeling.gguf import converted
from workers.serving import grammar_tokenizer as module
from workers.serving.grammar import SLICES, GrammarCompiler
from workers.serving.grammar_tokenizer import grammar_tokenizer, misread_tokens
from workers.serving.json_schema import JSON_OBJECT, InvalidSchema, grammar_of

# the decoder transformers 5.17 writes for SmolLM2's GGUF file (5.25 writes its ByteLevel step alone)
HYBRID_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    ],
}
TEXT = 'Paris, "naïve" café: 5€ {"a": [1, 2]}\n\tend'


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return converted(smollm2_file(), smollm2_cache(tmp_path_factory))


@pytest.fixture(scope="module")
def hybrid(smollm2, tmp_path_factory):
    """SmolLM2 as transformers 5.17 converts it: the same vocabulary, decoded the same way."""
    path = tmp_path_factory.mktemp("hybrid") / "smollm2"
    shutil.copytree(smollm2, path, ignore=shutil.ignore_patterns("*.safetensors"))
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["decoder"] = HYBRID_DECODER
    (path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == AutoTokenizer.from_pretrained(smollm2).decode(ids) == TEXT
    return tokenizer


def build(tokenizer) -> llguidance.LLTokenizer:
    return grammar_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id], SLICES)


def allowed_after(tokenizer, text: str) -> list[str]:
    """The tokens a JSON object's grammar allows after `text` (its tokens), decoded."""
    matcher = llguidance.LLMatcher(build(tokenizer), grammar_of(JSON_OBJECT), log_level=0)
    assert matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)), matcher.get_error()
    mask = llguidance.numpy.allocate_token_bitmask(1, len(tokenizer))
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    ids = [i for i in range(len(tokenizer)) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
    return [tokenizer.decode([i]) for i in ids]


def test_a_byte_level_vocabulary_under_a_sentencepiece_style_decoder_is_read_as_byte_level(hybrid):
    raw = llguidance.LLTokenizer(hybrid.backend_tokenizer.to_str(), n_vocab=len(hybrid))
    assert len(misread_tokens(raw, hybrid)) > 30_000  # what llguidance makes of the file as it is
    assert misread_tokens(build(hybrid), hybrid) == []
    after_key = allowed_after(hybrid, '{"type":')  # the grammar writes ": " (compact JSON)
    assert " " in after_key and " {" in after_key and ":" not in after_key


def test_tokenizers_llguidance_reads_right_are_taken_as_they_are(smollm2):
    byte_level = AutoTokenizer.from_pretrained(smollm2)
    assert misread_tokens(build(byte_level), byte_level) == []
    sentencepiece = tokenizer_kinds.sentencepiece_style()  # Llama 2's decoder; <0xFF> is left aside
    assert misread_tokens(build(sentencepiece), sentencepiece) == []


def test_a_tokenizer_llguidance_misreads_or_cannot_read_gets_a_400_saying_so(hybrid, monkeypatch):
    with pytest.raises(InvalidSchema, match="cannot read its tokenizer"):
        build(tokenizer_kinds.unigram_with_cleanup())  # a bare Metaspace decoder
    monkeypatch.setattr(module, "tokenizer_json", lambda tokenizer: tokenizer.backend_tokenizer.to_str())
    built = []
    monkeypatch.setattr(
        "workers.serving.grammar.grammar_tokenizer", lambda *args: built.append(1) or module.grammar_tokenizer(*args)
    )
    compiler = GrammarCompiler(hybrid, (hybrid.eos_token_id,), len(hybrid))
    for _ in range(2):  # the second is refused without building it again
        with pytest.raises(InvalidSchema, match=r"response_format is not available for this model: llguidance reads"):
            compiler.compile(JSON_OBJECT).result()
        compiler._cache.clear()
    assert built == [1]
    compiler.close()
