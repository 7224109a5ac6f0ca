"""Log-probabilities in OpenAI's shapes, from the target's raw ones the engine recorded (`TokenLogprob`).

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`. Completions
(legacy): `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, the top dict
holding the chosen token too (as vLLM). A token's text is its bytes decoded (U+FFFD for a piece of a
multi-byte character), its bytes exact: read from the tokenizer's table, never re-encoded text.
"""

from __future__ import annotations

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


def completion_logprobs(entries, token_bytes: TokenBytes, offset: int = 0) -> dict:
    """The completions `logprobs` object; `offset`: characters of the completion before these tokens."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        text = _text(token_bytes(e.token))
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e.logprob is None:  # an echoed prompt's first token: nothing predicts it
            tops.append(None)
            continue
        top = {_text(token_bytes(t)): v for t, v in e.top}
        top.setdefault(text, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def text_length(entries, token_bytes: TokenBytes) -> int:
    """Characters the tokens' texts take (the next streamed chunk's offset)."""
    return sum(len(_text(token_bytes(e.token))) for e in entries)
