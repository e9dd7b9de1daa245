"""Incremental detokenization with stop strings.

Decodes only a short window of recent tokens per step (prefix/read offsets), holds back an
incomplete UTF-8 character and any tail that could still become a stop string, and cuts the text at
the first stop string.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # all decoded text so far
        self.emitted = 0  # characters of self.text already handed out
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Feed new tokens; returns (text that is now final, whether a stop string was hit)."""
        self.ids.extend(token_ids)
        self._advance(final=False)
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self._take(len(self.text)), True
            return self._take(len(self.text) - self._held_back()), False
        return self._take(len(self.text)), False

    def flush(self) -> str:
        """The rest of the text at the end of a stream not cut by a stop string, incomplete
        characters included."""
        self._advance(final=True)
        return self._take(len(self.text))

    def _advance(self, final: bool) -> None:
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for n in range(min(len(self.text), max(len(s) for s in self.stop) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
