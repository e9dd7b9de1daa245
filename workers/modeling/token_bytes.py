"""Each token's own bytes, for logprobs: OpenAI's `bytes` field exists so a client can join the
pieces of a character split across tokens, and a token's text is those bytes read as UTF-8.

Decoding a token alone gives neither: a piece of a character decodes to U+FFFD (whose bytes are not
the piece's), and a SentencePiece token such as `▁world` loses its space (a decoder strips the
space a text starts with). So the bytes come from the vocabulary string by the tokenizer's own
scheme: byte-level BPE maps each byte to a printable character (GPT-2's table, inverted here);
SentencePiece writes `▁` for a space and `<0xNN>` for a byte it has no token for; added tokens are
their text. A tokenizer of another kind falls back to the token decoded alone."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_chars() -> list[str]:
    """The printable character ByteLevel uses for each byte value 0..255, in byte order (GPT-2's
    table: printable bytes stand for themselves, the others for the characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def decoder_kinds(spec: dict | None) -> set[str]:
    """The types of a tokenizer decoder's steps (a Sequence's included)."""
    if not spec:
        return set()
    return {spec.get("type"), *(k for d in spec.get("decoders") or () for k in decoder_kinds(d))}


@functools.lru_cache(maxsize=4)  # the tokenizers served lately (a swap brings another)
def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """The tokenizer's token id -> the bytes that token stands for (memoized per id)."""
    backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
    kinds = decoder_kinds(json.loads(backend.decoder.__getstate__())) if backend and backend.decoder else set()
    added = {i: t.content for i, t in (backend.get_added_tokens_decoder().items() if backend else ())}

    def alone(token_id: int) -> bytes:
        return tokenizer.decode([token_id]).encode()

    if "ByteLevel" in kinds:
        chars = {ch: b for b, ch in enumerate(byte_level_chars())}

        def of_vocab(token_id: int) -> bytes:
            piece = backend.id_to_token(token_id)
            if piece is None or any(c not in chars for c in piece):
                return alone(token_id)
            return bytes(chars[c] for c in piece)
    elif kinds & {"Metaspace", "ByteFallback"} or "Replace" in kinds:

        def of_vocab(token_id: int) -> bytes:
            piece = backend.id_to_token(token_id)
            if piece is None:
                return alone(token_id)
            byte = BYTE_TOKEN.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode()
    else:
        of_vocab = alone

    @functools.cache
    def of(token_id: int) -> bytes:
        return added[token_id].encode() if token_id in added else of_vocab(token_id)

    return of
