"""The llguidance tokenizer of a model's tokenizer: which bytes each token id stands for, as the
grammar sees them. A mask is only right if they are the bytes the model's tokenizer decodes the
token to (`token_bytes`, what logprobs and stop strings use too).

llguidance reads the tokenizer's JSON itself, and guesses the vocabulary's scheme from its decoder.
transformers 5.17 converts SmolLM2's GGUF file into a byte-level vocabulary under a SentencePiece
style decoder (`ByteFallback, Fuse, Replace ▁, ByteLevel`), which decodes as its ByteLevel step
alone does; llguidance read that vocabulary as SentencePiece: 32,888 of its 49,152 tokens got other
bytes, and a mask allowed `:` where the grammar forced a space, so a sampled document failed
mid-way. Such a decoder is handed over as its ByteLevel step. Every token's bytes are then
compared with the tokenizer's own: a tokenizer llguidance still reads otherwise, or cannot read at
all (a bare Metaspace decoder), gets no grammar (a 400 saying why) rather than wrong masks."""

from __future__ import annotations

import json

import llguidance

from workers.modeling.token_bytes import decoder_kinds, token_bytes
from workers.serving.json_schema import InvalidSchema


def grammar_tokenizer(
    hf_tokenizer, n_vocab: int, eos_token_ids: list[int], slices: list[str]
) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for `hf_tokenizer` (a fast one), its `n_vocab` ids read as the
    tokenizer reads them; InvalidSchema when llguidance cannot read them so."""
    try:
        tokenizer = llguidance.LLTokenizer(
            tokenizer_json(hf_tokenizer), n_vocab=n_vocab, eos_token=eos_token_ids or None, slices=slices
        )
    except ValueError as e:
        raise InvalidSchema(
            f"response_format is not available for this model: llguidance cannot read its tokenizer ({e})"
        ) from None
    misread = misread_tokens(tokenizer, hf_tokenizer)
    if misread:
        first = misread[0]
        raise InvalidSchema(
            f"response_format is not available for this model: llguidance reads {len(misread)} of its tokenizer's "
            f"tokens as other bytes than the tokenizer decodes (e.g. id {first}: {tokenizer.decode_bytes([first])!r}, "
            f"not {token_bytes(hf_tokenizer)(first)!r})"
        )
    return tokenizer


def tokenizer_json(hf_tokenizer) -> str:
    """The tokenizer's JSON for llguidance: a decoder Sequence that holds a ByteLevel step becomes
    that step (what it decodes a byte-level vocabulary to: ByteFallback passes pieces that are not
    `<0xNN>` through, and `▁` is no ByteLevel character)."""
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence" and "ByteLevel" in decoder_kinds(decoder):
        spec["decoder"] = next(d for d in decoder["decoders"] if d.get("type") == "ByteLevel")
    return json.dumps(spec)


def misread_tokens(tokenizer: llguidance.LLTokenizer, hf_tokenizer) -> list[int]:
    """The ids of the vocabulary whose bytes `tokenizer` reads otherwise than `hf_tokenizer`
    decodes them. Added tokens aside (llguidance marks the special ones), and tokens holding the
    byte 0xFF (its marker: it reads `<0xFF>` as nothing), which no UTF-8 text holds."""
    of = token_bytes(hf_tokenizer)
    added = set(hf_tokenizer.backend_tokenizer.get_added_tokens_decoder())
    return [
        i
        for i in range(len(hf_tokenizer))
        if i not in added and b"\xff" not in of(i) and tokenizer.decode_bytes([i]) != of(i)
    ]
