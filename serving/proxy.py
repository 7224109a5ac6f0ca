"""Ray Serve's HTTP proxy made to answer as the single server does: one ASGI middleware (`PROXY_CALLBACK`).

A response no replica sent (replicas name themselves in `x-mirror-rt-replica`) is the proxy's own: its errors get
the app's envelope. A request whose replica was lost before answering (or that it refused with `x-mirror-rt-retry`)
is sent once more; a stream cut after its 200 ends with an SSE error, then `[DONE]`. Serve's "every replica at its
limit" is asked again for up to BUSY_PATIENCE_S before the 503. The page's files and `LIGHT` GETs are answered
here, outside Serve's request limits (every replica asked at once, one answer passed on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time

from mirror_rt.serving.errors import envelope

REPLICA_HEADER = b"x-mirror-rt-replica"
RETRY_HEADER = b"x-mirror-rt-retry"  # a replica whose engine stopped before answering: send it elsewhere
PROXY_CALLBACK = "mirror_rt.serving.proxy:middlewares"
APP, DEPLOYMENT = "mirror-rt", "MirrorReplica"  # the Serve application `mirror-rt serve` deploys, and its deployment
RETRIES = 1  # a request whose replica died before answering is sent once more
BUSY_PATIENCE_S, BUSY_RETRY_S = 0.5, 0.05  # Serve's "at its limit" is asked again for this long, this often
LOST = "the replica serving this request was lost"
PAGE_VARIABLE = "MIRROR_RT_PAGE"  # "1": the proxy serves the playground page's files itself (`serve` without --no-ui)
LIGHT = ("/health", "/metrics", "/server")  # GETs that take no generation slot: asked of every replica at once
log = logging.getLogger("ray.serve")


def middlewares() -> list:
    """Serve's proxy callback: the middlewares its HTTP proxy wraps itself in."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLoss)]


class ReplicaLoss:
    """Retry what a lost replica never answered; envelope the proxy's own errors; close cut streams."""

    def __init__(self, app, retries: int = RETRIES):
        self.app, self.retries = app, retries

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "GET" and await answer_here(scope, send):
            return None
        body = await _read_body(receive)
        if body is None:  # the client left before its request was read
            return None
        client, attempt, patience = Client(body, receive), 0, time.monotonic() + BUSY_PATIENCE_S
        while True:
            reply = Reply(send, hold_busy=time.monotonic() < patience)
            try:
                await self.app(scope, client.receive_again(), reply.send)
            except Exception as exc:  # noqa: BLE001 -- the proxy's failure; decided below like a silent end
                reply.error = f"{type(exc).__name__}: {exc}"
            if client.gone:  # the proxy stopped because the client left: nobody to answer
                return None
            if reply.busy:  # Serve's count of its queue lags under a burst: ask again while replicas may have room
                await asyncio.sleep(BUSY_RETRY_S)
                continue
            if reply.started or attempt == self.retries:
                return await reply.finish()
            log.warning("mirror-rt: %s before answering %s %s; sending it again", LOST, scope.get("method"),
                        scope.get("path"))
            _count("retries")
            attempt += 1


class Reply:
    """One attempt's response on its way to the client."""

    def __init__(self, send, hold_busy: bool = False):
        self.client_send, self.started, self.ended = send, False, False
        self.hold_busy, self.busy = hold_busy, False  # Serve's "at its limit" held back (to ask again), not sent
        self.event_stream, self.error = False, None
        self.rewrite: dict | None = None  # the proxy's own error response, held until its body is read
        self.held: list | None = None  # a replica's "retry elsewhere" answer, sent only by the last attempt

    async def send(self, message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = dict(message.get("headers", []))
            self.event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if RETRY_HEADER in headers:
                self.held = [message]
                return
            if REPLICA_HEADER not in headers and message["status"] >= 400:
                self.rewrite = {"status": message["status"], "headers": message.get("headers", []), "body": b""}
                return
            self.started = True
        elif kind == "http.response.body" and self.held is not None:
            self.held.append(message)
            return
        elif kind == "http.response.body" and self.rewrite is not None:
            self.rewrite["body"] += message.get("body", b"")
            if message.get("more_body", False):
                return
            if _backpressure(self.rewrite["status"], self.rewrite["body"].decode(errors="replace")):
                if self.hold_busy:
                    self.busy = True
                    return
                _count("rejected")
            await self._send_enveloped()
            return
        elif kind == "http.response.body":
            self.ended = not message.get("more_body", False)
        await self.client_send(message)

    async def _send_enveloped(self) -> None:
        """The proxy's own error, in the app's envelope (Retry-After and the like kept)."""
        status, text = self.rewrite["status"], self.rewrite["body"].decode(errors="replace").strip()
        body = json.dumps(envelope(status, _proxy_message(status, text))).encode()
        keep = [(k, v) for k, v in self.rewrite["headers"] if k.lower() not in (b"content-type", b"content-length")]
        headers = [*keep, (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        self.rewrite, self.started = None, True
        await self.client_send({"type": "http.response.start", "status": status, "headers": headers})
        await self.client_send({"type": "http.response.body", "body": body, "more_body": False})
        self.ended = True

    async def finish(self) -> None:
        """End what the attempt left open: an error answer, or a cut stream's closing events."""
        if self.ended:
            return
        if self.held is not None:  # the last attempt: the replica's own answer after all
            for message in self.held:
                await self.client_send(message)
            self.ended = True
            return
        if not self.started:
            self.rewrite = {"status": 500, "headers": [], "body": f"{LOST} ({self.error or 'no answer'})".encode()}
            return await self._send_enveloped()
        closing = b""
        if self.event_stream:
            event = envelope(500, f"{LOST} while streaming; the text above is incomplete")
            closing = b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
        await self.client_send({"type": "http.response.body", "body": closing, "more_body": False})
        self.ended = True


# --- what the proxy answers without a replica's request slot ------------------------------------------


async def answer_here(scope, send) -> bool:
    """Answer a GET of the page's files or of `LIGHT` without a replica's slot (so they answer while every
    replica is busy); False for anything else, or where no replica can be reached that way."""
    path = scope["path"]
    if os.environ.get(PAGE_VARIABLE) == "1" and (path == "/" or path.startswith("/ui/")):
        status, headers, body = _page_file(path)
    elif path in LIGHT:
        answers = await _ask_every_replica(scope)
        if not answers:
            return False
        status, headers, body = _chosen(path, answers)
    else:
        return False
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
    return True


def _page_file(path: str) -> tuple[int, list, bytes]:
    from mirror_rt.serving.page import HEADERS, TYPES, page_files

    global _page
    _page = _page if _page is not None else page_files()
    name = "index.html" if path == "/" else path[len("/ui/"):]
    if name not in _page:
        body = json.dumps(envelope(404, f"not found: GET {path}")).encode()
        return 404, [(b"content-type", b"application/json")], body
    headers = {**HEADERS, "Content-Type": TYPES[name[name.rfind("."):]]}
    return 200, [(k.lower().encode(), v.encode()) for k, v in headers.items()], _page[name]


async def _ask_every_replica(scope) -> list[tuple]:
    """(status, headers, body) of every replica that answered `scope` (a GET) through its `answer` method."""
    global _handle
    try:
        if _handle is None:
            from ray import serve

            _handle = serve.get_deployment_handle(DEPLOYMENT, APP)
        response = _handle.broadcast(
            "answer", "GET", scope["path"], scope.get("query_string", b""), list(scope.get("headers", [])))
        answers = await response.results_async(timeout_s=10, return_exceptions=True)
    except Exception as exc:  # noqa: BLE001 -- no app, no replica, Serve not running here: the usual path then
        log.info("mirror-rt: %s %s through the request path: %s", scope["method"], scope["path"], exc)
        return []
    return [a for a in answers if isinstance(a, tuple)]


def _chosen(path: str, answers: list[tuple]) -> tuple:
    """For /health any replica's 200 (the app serves while one does); for the others, the replicas in turn."""
    global _turn
    answers = sorted(answers, key=lambda a: dict(a[1]).get(REPLICA_HEADER, b""))
    ok = [a for a in answers if a[0] == 200] or answers
    if path == "/health":
        return ok[0]
    _turn += 1
    return ok[_turn % len(ok)]


async def call_app(app, method: str, path: str, query: bytes, headers: list) -> tuple[int, list, bytes]:
    """Run one bodiless request through the ASGI `app` in this process: (status, headers, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(bytes(k), bytes(v)) for k, v in headers], "client": None, "server": None}
    answer = {"status": 500, "headers": [], "body": b""}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            answer.update(status=message["status"], headers=list(message.get("headers", [])))
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return answer["status"], answer["headers"], answer["body"]


def _proxy_message(status: int, text: str) -> str:
    queue = re.search(r"max_queued_requests=(\d+)", text)
    if _backpressure(status, text) and queue:
        return f"the server is busy: every replica is at its limit and {queue[1]} requests wait; retry later"
    return text or f"the proxy answered {status}"


class Client:
    """The client's side: its buffered body, replayed to each attempt, and whether it has left."""

    def __init__(self, body: bytes, receive):
        self.body, self.receive, self.gone = body, receive, False

    def receive_again(self):
        """A `receive` for one attempt: the body once, then the client's next message (its disconnect)."""
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            message = await self.receive()
            self.gone = self.gone or message["type"] == "http.disconnect"
            return message

        return receive


async def _read_body(receive) -> bytes | None:
    """The whole request body, or None when the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _backpressure(status: int, text: str) -> bool:
    """Whether the proxy's own error is Serve's "every replica at its limit" (max_queued_requests)."""
    return status == 503 and "backpressure" in text.lower()


COUNTERS = {  # the proxy's own counts, in Ray's metrics export (ray_mirror_rt_...) of the proxy's node
    "retries": ("mirror_rt_proxy_retries", "Requests sent again because their replica was lost", {}),
    "rejected": ("mirror_rt_proxy_rejected", "Requests refused (503): every replica at its limit",
                 {"reason": "queue_full"}),
}


def _count(name: str) -> None:
    """Add one to the proxy's counter `name` (COUNTERS; only when Ray runs this proxy)."""
    try:
        if name not in _counters:
            from ray.util.metrics import Counter

            metric, description, tags = COUNTERS[name]
            _counters[name] = (Counter(metric, description, tag_keys=tuple(tags)), tags)
        counter, tags = _counters[name]
        counter.inc(1, tags=tags or None)
    except ImportError:
        pass


_counters: dict = {}
_page = None  # the page's files, read at the first request for one
_handle = None  # the replicas' deployment, reached outside the request limits
_turn = 0  # which replica's answer of a LIGHT request goes out next
