"""Incremental detokenization with stop strings.

Decodes only a short window of recent tokens per step (prefix/read offsets), holds back an
incomplete UTF-8 character and any tail that could still become a stop string, and cuts the text at
the first stop string.

Stop strings are matched by one KMP automaton each, advanced over every newly decoded character:
amortized O(1) per character and stop string, whatever the stop string's length or the text's. The
text not yet handed out is the held-back tail plus the new characters, never the whole text.

The decode window starts in the prompt's last tokens (PROMPT_CONTEXT_TOKENS), as vLLM's does: a
completion's first token then reads as it does after its prompt. Decoded alone, a SentencePiece
token such as `▁capital` loses its leading space, so "The" + "capital" would run together.

The text is the tokenizer's decode without clean-up of spaces: a clean-up ("it ?" to "it?", "don '
t" to "don't") rewrites text across token boundaries, which no stream can take back once it has
sent it. Byte-level and SentencePiece tokenizers clean up nothing anyway (transformers ignores the
flag for BPE); WordPiece, Unigram and WordLevel ones decode here as if the flag were off.

A ByteFallback decoder (Llama-2 and Mistral tokenizers: a byte with no token of its own is written
`<0xNN>`) turns a run of byte tokens that holds any invalid UTF-8 into one U+FFFD per byte, valid
characters of the run included, so a window's text would depend on where the window starts and ends
(how many tokens a read holds, the prompt's last bytes). Here each run decodes as UTF-8 with the
standard replacement, one U+FFFD per invalid sequence (`_standard_byte_runs`): the same text
whatever the reads.

A stream continued on another replica (failover) goes on from `state()`: with the same prompt and
token ids, `restore` gives a detokenizer that hands out exactly what the original would have handed
out next.

A stream is read a batch of tokens at a time (its coalesced read), and each read is decoded at once:
two decode calls whatever the read holds, so a busy replica, whose reads hold more tokens, pays less
per token. With stop strings, `add_tokens` keeps a read whole unless a stop string or a split
character makes the token it ends at matter, and only then goes token by token.
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Callable, Sequence
from typing import NamedTuple

from workers.modeling.token_bytes import BYTE_TOKEN, decoder_kinds, token_bytes

MAX_SPLIT_TOKENS = 3  # tokens past the last whole character: a UTF-8 character has at most 4 bytes
PROMPT_CONTEXT_TOKENS = 5  # of the prompt, where the decode window starts


class StopMatcher:
    """The KMP automaton of one stop string: `state` is the length of the longest prefix of the stop
    string that ends the text fed so far."""

    __slots__ = ("stop", "fail", "state")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        # fail[i]: the longest proper prefix of stop[: i + 1] that is also its suffix (prefix function)
        self.fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, ch: str) -> bool:
        """Advance over one character; True when the stop string now ends the text."""
        stop, k = self.stop, self.state
        while k and stop[k] != ch:
            k = self.fail[k - 1]
        if stop[k] == ch:
            k += 1
        if k == len(stop):
            self.state = self.fail[k - 1]
            return True
        self.state = k
        return False


class DetokState(NamedTuple):
    """Where a detokenizer stands apart from its token ids: its decode window (offsets into the
    prompt's context tokens followed by the output's) and the text it holds back because it could
    still become a stop string."""

    prefix: int
    read: int
    pending: str


@functools.lru_cache(maxsize=4)  # the tokenizers served lately (a swap brings another)
def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """The tokenizer's decode of token ids, special tokens skipped, spaces not cleaned up. A fast
    tokenizer decodes in its Rust backend directly (a copy whose decoder cleans up nothing, where
    the original's does): the text `tokenizer.decode` gives, without the ~6 us of Python it spends
    around each call (`bench/stop_strings.py`)."""
    if not getattr(tokenizer, "is_fast", False):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    backend = tokenizer.backend_tokenizer
    decode = _without_cleanup(backend).decode
    byte_of = _byte_fallback_tokens(backend)
    if not byte_of:
        return lambda ids: decode(ids, skip_special_tokens=True)
    id_of = {b: i for i, b in byte_of.items()}
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    return lambda ids: decode(
        ids if byte_of.keys().isdisjoint(ids) else _standard_byte_runs(ids, byte_of, id_of, special),
        skip_special_tokens=True,
    )


def _byte_fallback_tokens(backend) -> dict[int, int]:
    """{token id: byte} of the `<0xNN>` tokens when the decoder has a ByteFallback step and every
    byte has its token (else {}: the tokenizer's own decode stands)."""
    spec = json.loads(backend.decoder.__getstate__()) if backend.decoder else None
    if "ByteFallback" not in decoder_kinds(spec):
        return {}
    found = {}
    for piece, token_id in backend.get_vocab().items():
        byte = BYTE_TOKEN.fullmatch(piece)
        if byte:
            found[token_id] = int(byte.group(1), 16)
    return found if len(set(found.values())) == 256 else {}


def _standard_byte_runs(ids: list[int], byte_of: dict[int, int], id_of: dict[int, int], special: set[int]) -> list[int]:
    """`ids` with every run of byte tokens that is not valid UTF-8 rewritten as the byte tokens of
    its standard decoding (each invalid sequence one U+FFFD, valid characters kept). Special
    tokens, which the decode skips, neither end a run nor stay."""
    out: list[int] = []
    run: list[int] = []  # byte token ids

    def close() -> None:
        raw = bytes(byte_of[i] for i in run)
        try:
            raw.decode()
            out.extend(run)
        except UnicodeDecodeError:
            out.extend(id_of[b] for b in raw.decode(errors="replace").encode())
        run.clear()

    for token_id in ids:
        if token_id in byte_of:
            run.append(token_id)
        elif token_id not in special:
            if run:
                close()
            out.append(token_id)
    if run:
        close()
    return out


def _ends_inside_character(tokenizer, ids: Sequence[int]) -> bool:
    """Whether the bytes of `ids` end in an incomplete UTF-8 character (a prompt that ends in a
    real U+FFFD does not)."""
    tail = b"".join(token_bytes(tokenizer)(i) for i in ids[-MAX_SPLIT_TOKENS - 1 :])
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(tail)
    return bool(decoder.getstate()[0])


def _without_cleanup(backend):
    """`backend`, or a copy of it whose decoder (WordPiece's, CTC's, in a sequence or not) does not
    clean up spaces."""
    decoder = backend.decoder
    if decoder is None:
        return backend
    spec = json.loads(decoder.__getstate__())

    def off(node) -> bool:
        if isinstance(node, list):
            return any([off(n) for n in node])  # a list: every node is turned off
        if not isinstance(node, dict):
            return False
        found = node.get("cleanup") is True
        if found:
            node["cleanup"] = False
        return any([off(v) for v in node.values()]) or found

    if not off(spec):
        return backend
    copy = type(backend).from_str(backend.to_str())
    plain = copy.decoder
    plain.__setstate__(json.dumps(spec).encode())
    copy.decoder = plain
    return copy


class IncrementalDetokenizer:
    """One request's completion text, handed out as its tokens arrive."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer)
        self.stop = stop
        context = list(prompt_ids[max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS) :])
        if context and self._decode(context).endswith("\ufffd") and _ends_inside_character(tokenizer, context):
            context = []
        self.ids: list[int] = context  # then the output's
        self.stopped = False  # a stop string was hit: nothing more is ever handed out
        self._matchers = [StopMatcher(s) for s in stop]
        self._longest = max(map(len, stop), default=0)
        self._pending = ""  # decoded text not handed out yet: the tail that could still become a stop string
        self._prefix = 0
        self._read = len(self.ids)

    def state(self) -> DetokState:
        """What `restore` needs, with the same prompt and output ids, to go on elsewhere from here."""
        return DetokState(self._prefix, self._read, self._pending)

    @classmethod
    def restore(
        cls, tokenizer, stop: tuple[str, ...], prompt_ids: Sequence[int], output_ids: list[int], state: DetokState
    ) -> IncrementalDetokenizer:
        """The detokenizer `state` was taken from, after `output_ids` of the prompt. The stop automata are rebuilt from
        the held-back text: it is the longest tail of the text that is a prefix of a stop string, so
        each automaton's state is the longest prefix of its stop string that ends it. ValueError for
        a state no stream could be in."""
        detok = cls(tokenizer, stop, prompt_ids)
        ids = detok.ids + list(output_ids)
        prefix, read, pending = state
        if not (isinstance(prefix, int) and isinstance(read, int) and 0 <= prefix <= read <= len(ids)):
            raise ValueError(f"decode offsets ({prefix!r}, {read!r}) outside the {len(ids)} token ids")
        if not isinstance(pending, str) or len(pending) >= max(detok._longest, 1):
            raise ValueError("held-back text longer than any stop string's prefix")
        for ch in pending:
            if any([m.feed(ch) for m in detok._matchers]):  # a list, not a generator: every automaton is fed
                raise ValueError("held-back text that holds a stop string")
        if max((m.state for m in detok._matchers), default=0) != len(pending):
            raise ValueError("held-back text that is not the tail a stop string could still match")
        detok.ids = ids
        detok._prefix, detok._read, detok._pending = prefix, read, pending
        return detok

    def add_tokens(self, token_ids: list[int]) -> tuple[int, str, bool]:
        """One read's new tokens: (how many of them count, their text, whether a stop string was
        hit). Every token counts unless a stop string is hit: then only those up to the one that
        completed it (the engine drew the rest past the stop), exactly as if the tokens had come
        one at a time. The read is decoded whole first; only when that finds a stop string, or
        hands out nothing (token by token, an earlier token might have), does it go again token by
        token from where it started."""
        if self.stopped:
            return 0, "", True
        if not self._matchers:
            text, hit = self.add(token_ids)
            return len(token_ids), text, hit
        if len(token_ids) > 1:
            start = (len(self.ids), self._prefix, self._read, self._pending, [m.state for m in self._matchers])
            text, hit = self.add(token_ids)
            if not hit and self._read > start[2] and self._stop_in_held() is None:  # as token by token
                return len(token_ids), text, False
            self._rewind(*start)
        text = ""
        for n, token in enumerate(token_ids, 1):
            piece, hit = self.add([token])
            text += piece
            if not hit and (before := self._stop_in_held()) is not None:
                text, hit, self.stopped, self._pending = text + before, True, True, ""
            if hit:
                return n, text, True
        return len(token_ids), text, False

    def _stop_in_held(self) -> str | None:
        """With the last tokens held back (they end inside a character), the text up to a stop
        string that the whole characters before that character complete: a token such as `Ġì`
        holds a space and the first byte of the next character, and a stop string ending in that
        space is complete at that token, not at the one that completes the character. None when
        no tokens are held or they complete no stop string."""
        if self._read == len(self.ids):
            return None
        whole = self._decode(self.ids[self._prefix :]).rstrip("\ufffd")
        text = self._pending + whole[len(self._decode(self.ids[self._prefix : self._read])) :]
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return text[: min(cuts)] if cuts else None

    def _rewind(self, ids: int, prefix: int, read: int, pending: str, states: list[int]) -> None:
        """Back to where a read started (before its tokens were added)."""
        del self.ids[ids:]
        self._prefix, self._read, self._pending, self.stopped = prefix, read, pending, False
        for m, state in zip(self._matchers, states):
            m.state = state

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Feed new tokens; returns (text that is now final, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        self.ids.extend(token_ids)
        new = self._advance(final=False)
        if not self._matchers:
            return new, False
        base = len(self._pending)  # where `new` starts in pending + new
        cut = self._first_stop(new, base)
        text = self._pending + new
        if cut is not None:
            self.stopped = True
            self._pending = ""
            return text[:cut], True
        held = max(m.state for m in self._matchers)
        self._pending = text[len(text) - held :]
        return text[: len(text) - held], False

    def flush(self, cut_short: bool = False) -> tuple[str, bool]:
        """The rest of the text at the end of a stream, incomplete characters included, cut at a
        stop string if it completes one (the text a split character held back until now may), and
        whether it did. `cut_short`: the stream was aborted mid-generation (a swap's drain timeout),
        so a character whose last bytes never came stays unsent: as U+FFFD it was text the whole
        generation never has."""
        if self.stopped:
            return "", True
        new = self._advance(final=not cut_short)
        base, text = len(self._pending), self._pending + new
        self._pending = ""
        cut = self._first_stop(new, base) if self._matchers else None
        if cut is None:
            return text, False
        self.stopped = True
        return text[:cut], True

    def _first_stop(self, new: str, base: int) -> int | None:
        """Feed `new` to every automaton; the start (in pending + new) of the earliest-starting stop
        string that ends within `new`, or None. Every such match starts within the pending text or
        `new`, as the pending text holds the longest tail that is a prefix of a stop string."""
        cut = None
        for i, ch in enumerate(new):
            end = base + i + 1
            if cut is not None and end - self._longest >= cut:
                break  # a match ending here or later starts after the cut
            for m in self._matchers:
                if m.feed(ch) and (cut is None or end - len(m.stop) < cut):
                    cut = end - len(m.stop)
        return cut

    def _advance(self, final: bool) -> str:
        """The newly decoded text up to the last token that ends a whole character (all of it when
        final): tokens that end inside one (a character's bytes split across tokens) wait for the
        rest of it. It looks back at most MAX_SPLIT_TOKENS tokens for that end, as far as a split
        character reaches, so an invalid byte sequence costs no more than that."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        end = len(self.ids)
        new_text = self._decode(self.ids[self._prefix : end])
        if not final:
            while new_text.endswith("\ufffd") and end > max(self._read, len(self.ids) - MAX_SPLIT_TOKENS):
                end -= 1
                new_text = self._decode(self.ids[self._prefix : end])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._prefix, self._read = self._read, end
            return new_text[len(prefix_text) :]
        return ""
