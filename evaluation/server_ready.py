"""`mirror-rt bench-serve`'s first look at the server: wait while it starts, or say in one line why it cannot be
benchmarked. Light to import (the CLI's parser reads its default)."""

from __future__ import annotations

import time

READY_TIMEOUT = 600.0  # seconds to wait for a server that is still starting (vLLM's bench: the same default)


class ServerError(RuntimeError):
    """The server cannot be benchmarked (unreachable, not ready in time, refusing us): one line for the user."""


def wait_until_ready(url: str, api_key: str | None, timeout: float = READY_TIMEOUT, log=print,
                     poll: float = 1.0) -> None:
    """Return once `url`'s `GET /v1/models` answers 200, waiting while the server is starting (connection refused,
    or 503 while it loads its model) for up to `timeout` seconds; ServerError otherwise, in one line."""
    import httpx

    models = url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline, said, last = time.monotonic() + timeout, False, "no answer"
    while True:
        try:
            response = httpx.get(models, headers=headers, timeout=10)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {_error_text(response)}"
            if response.status_code != 503:
                raise ServerError(f"{models} answered {last}")
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if not isinstance(exc, (httpx.ConnectError, httpx.TimeoutException, httpx.ReadError,
                                    httpx.RemoteProtocolError)):  # not a server still starting: a wrong URL
                raise ServerError(f"cannot reach {models}: {last}") from None
        if time.monotonic() + poll > deadline:
            raise ServerError(f"the server at {url} was not ready within {timeout:g} s (last: {last})")
        if not said:
            log(f"bench-serve: waiting up to {timeout:g} s for the server at {url} ({last})")
            said = True
        time.sleep(poll)


def envelope_message(body) -> str | None:
    """The one-line message of an error body: OpenAI's envelope (`error.message`), a bare `error` or `message`."""
    error = body.get("error", body) if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return " ".join(str(message).split())[:200] if message else None


def _error_text(response) -> str:
    """An error answer's message (OpenAI's envelope, or a bare `error` / `message`), else its reason phrase."""
    try:
        message = envelope_message(response.json())
    except ValueError:
        message = None
    if message:
        return message
    hint = " (not an OpenAI-compatible server at this URL?)" if response.status_code == 404 else ""
    return f"{response.reason_phrase}{hint}"
