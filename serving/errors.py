"""Errors over HTTP: vLLM's envelope everywhere, one line each.

Body: `{"error": {"message", "type", "param", "code": <HTTP status>}}` with vLLM's type names. Our `APIError`,
request validation (400, never 422), unknown routes, any other exception (500) and what uvicorn refuses before the
app (`json_errors_protocol`) all end in it.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
         405: "BadRequestError", 413: "BadRequestError", 415: "UnsupportedMediaTypeError", 500: "InternalServerError",
         503: "ServiceUnavailableError", 504: "TimeoutError"}
log = logging.getLogger("mirror_rt.serve")
MAX_MESSAGE = 1000  # characters of an error message: a client's long value quoted in one is cut in the middle


def one_line(message: str) -> str:
    """`message` on one line of at most MAX_MESSAGE characters (what it quotes of a request may be any length)."""
    flat = " ".join(message.splitlines())
    if len(flat) <= MAX_MESSAGE:
        return flat
    head, tail = flat[:MAX_MESSAGE * 2 // 3], flat[-MAX_MESSAGE // 4:]
    return f"{head} ... ({len(flat) - len(head) - len(tail)} characters left out) ... {tail}"


class APIError(Exception):
    """A request that ends with an error status; `headers` go on the response (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        return envelope(self.status, self.message, self.param)


def envelope(status: int, message: str, param: str | None = None) -> dict:
    """The error body for `status`."""
    return {"error": {"message": one_line(message), "type": TYPES.get(status, "InternalServerError"), "param": param,
                      "code": status}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def install_handlers(app: FastAPI) -> None:
    """Route every failure through the envelope."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(APIError(400, f"invalid request: {first.get('msg', 'malformed body')}", param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = "not found" if exc.status_code == 404 else str(exc.detail)
        return error_response(APIError(exc.status_code, f"{message}: {request.method} {request.url.path}"))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


def json_errors_protocol(on_error=None):
    """uvicorn's HTTP protocol class whose own 400 for an unparsable request is the envelope; `on_error(status)`
    counts it."""
    import json

    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class JSONErrors(AutoHTTPProtocol):
        def send_400_response(self, msg: str) -> None:
            if on_error is not None:
                on_error(400)
            body = json.dumps(envelope(400, "invalid HTTP request: the request line or a header cannot be parsed "
                                            "(control bytes, bad syntax, or too long)")).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return JSONErrors
