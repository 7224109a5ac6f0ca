"""Bodies the parser and the validators refuse, sent through a real server (uvicorn on a free port) over raw HTTP on
ONE keep-alive connection: each is a 4xx in the error envelope (never a 500), and the connection keeps serving
(a valid request after each one is answered on the same socket). A 5,000-digit number was a 500 (`ValueError:
Exceeds the limit (4300 digits)` uncaught in serving/intake.py), after which uvicorn closed the connection and the
client's next request was reset."""

from __future__ import annotations

import json
import random
import socket

import pytest

pytest.importorskip("fastapi")

MESSAGES = [{"role": "user", "content": "hi"}]
VALID = json.dumps({"messages": MESSAGES, "max_tokens": 1, "temperature": 0}).encode()
HUGE = "1" + "0" * 4999  # 5,000 digits
DEEP = 100_000

# raw bodies (bytes): what the JSON parser itself meets
RAW = {
    "5000-digit max_tokens": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}' % HUGE.encode(),
    "5000-digit unknown field": b'{"messages": [{"role": "user", "content": "hi"}], "x": %s}' % HUGE.encode(),
    "5000-digit negative seed": b'{"messages": [{"role": "user", "content": "hi"}], "seed": -%s}' % HUGE.encode(),
    "5000-digit number in a list": b'[%s]' % HUGE.encode(),
    "nested arrays 100k deep": b"[" * DEEP + b"]" * DEEP,
    "nested objects 100k deep": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "messages nested 5000 deep": b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "content nested 900 deep": b'{"messages": [{"role": "user", "content": ' + b"[" * 900 + b"]" * 900 + b"}]}",
    "temperature NaN": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    "top_p Infinity": b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
    "seed -Infinity": b'{"messages": [{"role": "user", "content": "hi"}], "seed": -Infinity}',
    "temperature 1e999": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
    "max_tokens 1e5": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e5}',
    "invalid UTF-8": b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
    "overlong UTF-8": b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}',
    "lone surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    "NUL byte in a string": b'{"messages": [{"role": "user", "content": "a\x00b"}]}',
    "two BOMs": b"\xef\xbb\xbf\xef\xbb\xbf{}",
    "empty body": b"",
    "whitespace only": b"  \n ",
    "cut short": b'{"messages": [{"role": "user", "content": "hi"',
    "trailing garbage": VALID + b"x",
    "two documents": VALID + VALID,
    "single quotes": b"{'messages': []}",
    "a comment": b'{"messages": [] /* no */}',
    "top-level array": b"[]",
    "top-level string": b'"hi"',
    "top-level number": b"5",
    "top-level null": b"null",
    "top-level true": b"true",
}
# values a request field must refuse (JSON text, spliced in raw)
WEIRD = [HUGE, "-" + HUGE, "NaN", "Infinity", "1e999", "-1", "0.5", "true", "null", '"5"', "[]", "{}", "[[[[[[]]]]]]",
         '{"a": {"b": {"c": []}}}', '"' + "x" * 10_000 + '"', "2e19", "-9223372036854775809"]
FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream",
          "stream_options", "logprobs", "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "response_format", "structured_outputs", "tools", "tool_choice", "user", "model",
          "mode", "num_assistant_tokens", "messages", "ignore_eos", "parallel_tool_calls", "echo"]


# the Responses API's fields (serving.openai_responses), and places inside its input items
RESPONSES_FIELDS = ["input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "metadata",
                    "previous_response_id", "include", "store", "truncation", "top_logprobs", "background",
                    "parallel_tool_calls", "temperature", "stream", "seed", "model"]
RESPONSES_VALID = {"input": "hi", "max_output_tokens": 1, "temperature": 0}
RESPONSES_INPUTS = ['[{"role": "user", "content": @@}]', '[{"type": "function_call", "call_id": @@, "name": "f", '
                    '"arguments": "{}"}]', '[{"type": "function_call_output", "call_id": "c", "output": @@}]',
                    '[{"type": @@}]', '[@@]', '[{"role": "user", "content": [{"type": "input_text", "text": @@}]}]']


def field_bodies(seed: int = 0, count: int = 160, fields: list[str] = FIELDS, base: dict | None = None
                 ) -> dict[str, bytes]:
    """`count` bodies, each a valid request (`base`: a chat's) with one field set to a weird value (seeded
    choice of pairs)."""
    pairs = [(f, w) for f in fields for w in WEIRD]
    random.Random(seed).shuffle(pairs)
    bodies = {}
    for field, weird in pairs[:count]:
        base = dict(base or {"messages": MESSAGES, "max_tokens": 1, "temperature": 0})
        base[field] = "@@"
        bodies[f"{field}={weird[:24]}"] = json.dumps(base).replace('"@@"', weird).encode()
    return bodies


class KeepAlive:
    """One HTTP/1.1 connection, kept: requests written and responses read by hand (no client reconnects)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.buffer = b""

    def post(self, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, dict, bytes]:
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.sock.sendall(head + body)
        return self._response()

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buffer += chunk
        out, self.buffer = self.buffer.split(marker, 1)
        return out

    def _read(self, size: int) -> bytes:
        while len(self.buffer) < size:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buffer += chunk
        out, self.buffer = self.buffer[:size], self.buffer[size:]
        return out

    def _response(self) -> tuple[int, dict, bytes]:
        lines = self._read_until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while (size := int(self._read_until(b"\r\n"), 16)) > 0:
                body += self._read(size)
                self._read(2)
            self._read(2)
            return status, headers, body
        return status, headers, self._read(int(headers.get("content-length", 0)))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def connection(server):
    """One keep-alive connection for the test's every request."""
    kept = KeepAlive(server.port)
    yield kept
    kept.close()


def check_refused(connection: KeepAlive, case: str, body: bytes, path: str = "/v1/chat/completions") -> int:
    status, headers, answer = connection.post(body, path)
    assert status != 500, f"{case}: {answer[:300]!r}"
    if status >= 400:
        error = json.loads(answer)["error"]
        assert error["code"] == status and error["type"] and error["message"], case
        assert "\n" not in error["message"] and len(error["message"]) < 2000, f"{case}: {error['message'][:300]}"
    assert headers.get("connection", "").lower() != "close", case
    again, _, text = connection.post(VALID)  # the same socket still serves
    assert again == 200, f"after {case}: {text[:300]!r}"
    return status


@pytest.mark.parametrize("case", list(RAW))
def test_a_body_the_parser_refuses_is_a_400_and_the_connection_stays(connection, case):
    status = check_refused(connection, case, RAW[case])
    assert status in (400, 404), case


def test_a_5000_digit_number_says_what_is_wrong(connection):
    status, _, answer = connection.post(RAW["5000-digit unknown field"])
    message = json.loads(answer)["error"]["message"]
    assert status == 400 and "5000 digits" in message and "4300" in message, message


def test_a_body_with_a_bom_or_duplicate_keys_is_read_as_json_reads_it(connection):
    """RFC 8259 lets a parser ignore a UTF-8 BOM; a duplicated key keeps its last value (as Python, JS, pydantic)."""
    status, _, _ = connection.post(b"\xef\xbb\xbf" + VALID)
    assert status == 200
    status, _, answer = connection.post(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, '
                                        b'"temperature": 0, "max_tokens": 2}')
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] <= 2


def test_fields_set_to_weird_values_never_end_in_a_500(connection):
    for case, body in field_bodies().items():
        check_refused(connection, case, body)


def test_an_internal_error_is_a_500_envelope_and_the_connection_stays(server, connection, monkeypatch):
    """What no validator foresaw ends in the envelope; uvicorn closed the connection after every 500."""
    from mirror_rt.serving import app

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(app, "refuse_unread", broken)
    status, headers, answer = connection.post(VALID)
    assert status == 500 and json.loads(answer)["error"]["message"] == "internal error: RuntimeError: injected"
    assert headers.get("connection", "").lower() != "close"
    monkeypatch.undo()
    assert connection.post(VALID)[0] == 200


def test_responses_fields_set_to_weird_values_never_end_in_a_500(connection):
    """The same over /v1/responses: its own fields, and weird values inside its input items."""
    bodies = field_bodies(seed=1, fields=RESPONSES_FIELDS, base=RESPONSES_VALID)
    for i, place in enumerate(RESPONSES_INPUTS):
        for weird in WEIRD:
            body = json.dumps({**RESPONSES_VALID, "input": "@@"}).replace('"@@"', place.replace("@@", weird))
            bodies[f"input item {i}={weird[:24]}"] = body.encode()
    for case, body in bodies.items():
        check_refused(connection, case, body, "/v1/responses")


def test_completion_prompt_lists_of_weird_values_never_end_in_a_500(connection):
    """A batch of prompts (a list of texts or of id lists) with one weird member."""
    for weird in WEIRD:
        for place in ('["hi", @@]', "[[1, 2], @@]", "[[1, @@]]", "[@@, [3]]"):
            body = json.dumps({"prompt": "@@", "max_tokens": 1}).replace('"@@"', place.replace("@@", weird))
            check_refused(connection, f"prompt {place}={weird[:24]}", body.encode(), "/v1/completions")
