"""The hash chain that names a full KV page by everything its keys and values depend on.

A page's K/V are a function of every token up to its end and of the weights that computed them,
so a page's hash covers its own tokens and the hash of the page before it (one link of a chain,
as vLLM's block hashes do) and, at the root, a salt naming the weights beyond the base model: the
LoRA adapter and its load generation. Two sequences share a page only when their hashes agree,
i.e. when their whole prefix and adapter agree. SHA-256, not Python's `hash`: a collision would
hand one request another's KV (and a crafted one, a tenant's prompt), and str hashes differ per
process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_ROOT = b"graphserve-prefix-v1\0"


def page_hashes(tokens: Sequence[int], page_size: int, salt: bytes, known: Sequence[bytes] = ()) -> list[bytes]:
    """The chain hash of every full page of `tokens`. `known`: the hashes already computed for
    its first pages (same tokens, same salt), extended rather than computed again, since a
    sequence only grows."""
    out = list(known)
    parent = out[-1] if out else hashlib.sha256(_ROOT + salt).digest()
    first, pages = len(out) * page_size, len(tokens) // page_size - len(out)
    if pages <= 0:
        return out
    # Fixed widths (32-byte parent, 8 bytes a token): the concatenation reads only one way.
    packed, width = array("q", tokens[first : first + pages * page_size]).tobytes(), 8 * page_size
    for start in range(0, pages * width, width):
        parent = hashlib.sha256(parent + packed[start : start + width]).digest()
        out.append(parent)
    return out


def adapter_salt(name: str, path: str, generation: int) -> bytes:
    """The salt of a sequence decoded with a LoRA adapter: its name, path and which load of it
    (a reload may read other weights from the same path); b"" is the base model's."""
    return f"lora\0{name}\0{path}\0{generation}".encode()
