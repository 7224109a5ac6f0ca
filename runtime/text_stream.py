"""Committed token ids to streamed text, with end-of-sequence and stop-string handling.

`push` returns the text that is now final: nothing printed is ever taken back. Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Incremental detokenizer for one generation."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.min_tokens = min_tokens  # stop strings count from the text after this many tokens (vLLM's min_tokens)
        self.stop_floor = 0  # the characters of the text before then: released, never searched
        self.tokens: list[int] = []  # delivered tokens (EOS excluded)
        self.emitted = 0  # characters of the decoded text already returned
        self.decoded = ""  # the text of tokens[:read_offset], stable
        self.prefix_offset = 0  # tokens decoded again as context of the next piece
        self.read_offset = 0  # tokens whose text is in `decoded`
        self.text = ""  # the final text once done
        self.stop_reason: str | None = None  # "eos" | "stop_string" once done

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def push(self, token: int) -> str:
        """Add one committed token; returns newly final text ('' if none)."""
        if self.done:
            return ""
        if token in self.eos:
            self.stop_reason = "eos"
            return self.flush()
        self.tokens.append(token)
        piece = self._new_text()
        if piece and not piece.endswith("\ufffd"):  # a split multi-byte character waits for its rest
            self.decoded += piece
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        decoded = self.decoded
        if len(self.tokens) < self.min_tokens:  # no stop string yet: all of it is final
            self.stop_floor = len(decoded)
            return self._emit(decoded)
        hit = self._find_stop(decoded)
        if hit is not None:
            self.stop_reason = "stop_string"
            return self._emit(decoded[:hit])
        safe = len(decoded) - self._unsafe_suffix(decoded)
        return self._emit(decoded[:safe])

    def flush(self) -> str:
        """End of generation: release any held-back text."""
        if self.stop_reason == "stop_string":
            return ""
        return self._emit(self.decoded + self._new_text())

    def _new_text(self) -> str:
        """Text the tokens after `read_offset` add (decoded with a little context before them)."""
        before = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self.tokenizer.decode(self.tokens[self.prefix_offset:])
        return after[len(before):] if len(after) > len(before) else ""

    def _emit(self, final: str) -> str:
        piece = final[self.emitted:] if len(final) > self.emitted else ""
        self.emitted = max(self.emitted, len(final))
        self.text = final if len(final) >= len(self.text) else self.text
        return piece

    def _find_stop(self, decoded: str) -> int | None:
        if not self.stop_strings:
            return None
        longest = max(len(s) for s in self.stop_strings)
        start = max(self.stop_floor, self.emitted - longest)
        hits = [i for s in self.stop_strings if (i := decoded.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _unsafe_suffix(self, decoded: str) -> int:
        """Characters at the end that may still begin a stop string."""
        return max((next((n for n in range(min(len(s) - 1, len(decoded)), 0, -1) if decoded.endswith(s[:n])), 0)
                    for s in self.stop_strings), default=0)  # per stop string, its longest prefix found: no more
