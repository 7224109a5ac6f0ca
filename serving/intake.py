"""A request's intake before it is parsed: its API key (401), its JSON body (415, 400), a prompt too long to read.
"""

from __future__ import annotations

import json
import secrets
import sys

from starlette.requests import ClientDisconnect, Request

from mirror_rt.serving import protocol
from mirror_rt.serving.errors import APIError


def refuse_unread(texts: list, engine, context: int, requested: int) -> None:
    """A 400 for `texts` whose characters alone need more tokens than the `context` served holds, before they are
    tokenized (the tokenizer holds the GIL: no other request moves meanwhile)."""
    least = -(-sum(len(t) for t in texts if isinstance(t, str)) // engine.tokenizer.longest_token_chars)
    if least > context:
        raise protocol.context_error(context, least, requested)


def check_key(request: Request, state) -> None:
    key = state.settings.api_key
    if not key:
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    if not secrets.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "Invalid API key" if token else "Missing API key: send 'Authorization: Bearer <key>'")


async def read_json(request: Request):
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        # a browser sends text/plain or a form without a CORS preflight: no page may post here unasked
        raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json' (got "
                            f"{repr(kind) if kind else 'none'})")
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body: nobody reads the answer, nothing to log
        raise APIError(400, "the client closed the connection before sending the request body") from None
    return parse_json(raw)


def parse_json(raw: bytes):
    """The body as JSON; every way it can fail to be JSON a 400 of one line (never a 500: uvicorn closes the
    connection after one)."""
    try:
        body = json.loads(raw, parse_int=_whole_number)
        json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate ("\\ud800") is JSON but no text
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None
    except UnicodeEncodeError:
        raise APIError(400, "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text") from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply") from None
    return body


def _whole_number(text: str) -> int:
    """A JSON integer; one of more digits than Python converts (sys.get_int_max_str_digits) is refused by name."""
    digits = len(text.lstrip("-"))
    limit = sys.get_int_max_str_digits()
    if limit and digits > limit:
        raise APIError(400, f"the request body holds an integer of {digits} digits: at most {limit} are read")
    return int(text)
