"""Log-probabilities in OpenAI's shapes, from the target's raw ones the engine recorded (`TokenLogprob`).

Chat: `{"content": [{token, logprob, bytes, top_logprobs}]}`; completions: `{tokens, token_logprobs, top_logprobs,
text_offset}`, the top dict holding the chosen token too (as vLLM). A token's bytes are exact (the tokenizer's
table), its text those bytes decoded (U+FFFD for part of a character).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

from mirror_rt.runtime.grammar import grammar_tokenizer

TokenBytes = Callable[[int], bytes]


def token_bytes_of(engine) -> TokenBytes:
    """Each token id's bytes (llguidance's table of the tokenizer, else the tokenizer's own decode)."""
    try:
        table = grammar_tokenizer(engine.tokenizer, engine.target.vocab_size)
        return lambda token: table.decode_bytes([token])
    except ValueError:
        return lambda token: engine.tokenizer.decode([token]).encode()


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _entry(token: int, logprob: float, token_bytes: TokenBytes) -> dict:
    data = token_bytes(token)
    return {"token": _text(data), "logprob": logprob, "bytes": list(data)}


def chat_logprobs(entries, token_bytes: TokenBytes) -> dict:
    """The chat `logprobs` object of a choice (or of one streamed chunk)."""
    return {"content": [{**_entry(e.token, e.logprob, token_bytes),
                         "top_logprobs": [_entry(t, v, token_bytes) for t, v in e.top]} for e in entries],
            "refusal": None}


class TextOffsets:
    """OpenAI's `text_offset`: the characters of a completion's text before each token; a character split over
    several tokens counts once it is whole, so every offset indexes the text."""

    def __init__(self, entries=(), token_bytes: TokenBytes | None = None):
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for e in entries:
            self.next(token_bytes(e.token))

    def next(self, data: bytes) -> int:
        """The offset of the token of bytes `data`, the text so far then moved past it."""
        at = self.chars
        self.chars += len(self._decoder.decode(data))
        return at


def completion_logprobs(entries, token_bytes: TokenBytes, at: TextOffsets | None = None) -> dict:
    """The completions `logprobs` object; `at`: the completion's text offsets before these tokens (moved past)."""
    at = at or TextOffsets()
    tokens, offsets, tops = [], [], []
    for e in entries:
        data = token_bytes(e.token)
        text = _text(data)
        tokens.append(text)
        offsets.append(at.next(data))
        if e.logprob is None:  # an echoed prompt's first token: nothing predicts it
            tops.append(None)
            continue
        top = {_text(token_bytes(t)): v for t, v in e.top}
        top.setdefault(text, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}
