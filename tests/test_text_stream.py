"""Streaming text: nothing printed is taken back; EOS and stop strings end the text."""

from mirror_rt.models.tokenizer import ByteTokenizer
from mirror_rt.runtime.text_stream import TextStream


def push_all(stream, text_ids):
    return "".join(stream.push(t) for t in text_ids) + stream.flush()


def test_stop_string_cuts_and_is_never_printed():
    tok = ByteTokenizer()
    stream = TextStream(tok, eos_token_ids=[1], stop_strings=["END"])
    pieces = [stream.push(t) for t in tok.encode("abc EN")]
    assert "".join(pieces) == "abc "  # "EN" held back: it may start "END"
    pieces += [stream.push(t) for t in tok.encode("D more")]
    assert "".join(pieces) + stream.flush() == "abc " and stream.stop_reason == "stop_string"


def test_held_back_prefix_released_when_not_a_stop():
    tok = ByteTokenizer()
    stream = TextStream(tok, stop_strings=["END"])
    assert push_all(stream, tok.encode("x EN y")) == "x EN y"


def test_eos_ends_without_printing():
    tok = ByteTokenizer()
    stream = TextStream(tok, eos_token_ids=[1])
    text = push_all(stream, tok.encode("hi") + [1] + tok.encode("no"))
    assert text == "hi" and stream.stop_reason == "eos" and stream.tokens == tok.encode("hi")


def test_split_utf8_character_is_held_until_complete():
    tok = ByteTokenizer()
    stream = TextStream(tok)
    ids = tok.encode("é")  # two bytes
    assert stream.push(ids[0]) == ""
    assert stream.push(ids[1]) == "é"


def test_stop_strings_count_from_the_text_after_min_tokens():
    """vLLM's min_tokens: a stop string in the first min_tokens tokens' text is text; one after them stops, and
    what was printed before is never taken back."""
    tok = ByteTokenizer()
    stream = TextStream(tok, stop_strings=[","], min_tokens=3)
    pieces = [stream.push(t) for t in tok.encode("a,b")]
    assert pieces == ["a", "a,"[1:], "b"] and not stream.done
    assert push_all(stream, tok.encode(",c")) == "" and stream.text == "a,b" and stream.stop_reason == "stop_string"
    assert push_all(TextStream(tok, stop_strings=[","]), tok.encode("a,b,c")) == "a"
