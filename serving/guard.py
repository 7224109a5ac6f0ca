"""Who may talk to the server, and the count of every answer: an ASGI middleware in front of every route.

Refused with a 403 before any route: a `Host` the server does not answer to (DNS rebinding; a loopback `--host`
answers to `localhost`, its subdomains and IP addresses, one beyond it to every name unless `--allowed-hosts` names
them), and a browser request from another origin not in `--allowed-origins` (requests without `Origin` and the
server's own page pass; an allowed origin gets CORS headers and its preflight). Every response is counted by
route template (`none` without one), method and status (`ServerState.responded`), streams when they end. An
exception no handler took becomes a 500 envelope here, the connection kept (Starlette re-raises it to uvicorn,
which closes the connection).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from mirror_rt.serving.errors import APIError, error_response, log

DEFAULT_PORTS = {"http": 80, "https": 443}
EXPOSED = "Retry-After, x-mirror-rt-replica"


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def listens_locally(host: str) -> bool:
    """Whether `--host` binds this machine's loopback only (127.0.0.1, ::1, localhost)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def authority(scheme: str, netloc: str) -> tuple[str, int | None]:
    """(name, port) of a Host header or an origin's authority, normalized; the scheme's default port if none."""
    netloc = netloc.strip().lower()
    if netloc.startswith("[") and "]" in netloc:  # [::1]:8000
        end = netloc.index("]")
        name, rest = netloc[1:end], netloc[end + 1:]
        port = rest[1:] if rest.startswith(":") else ""
    elif netloc.count(":") == 1:
        name, port = netloc.split(":")
    else:
        name, port = netloc, ""
    return name.rstrip("."), int(port) if port.isdigit() else DEFAULT_PORTS.get(scheme)


def host_name(value: str) -> str:
    return authority("", value)[0]


class Rules:
    """The origins and host names a server takes (`ServerConfig.allowed_origins`, `allowed_hosts`, `host`)."""

    def __init__(self, settings):
        self.origins = {o.strip().rstrip("/").lower() for o in settings.allowed_origins}
        self.hosts = {host_name(h) for h in settings.allowed_hosts}
        self.local = listens_locally(settings.host)
        self.own = host_name(settings.host)

    def host_refusal(self, host: str | None) -> str | None:
        """Why a request for `host` (its Host header; None: none sent) is refused, or None."""
        if host is None or "*" in self.hosts:
            return None
        name = host_name(host)
        if is_ip(name) or name == "localhost" or name.endswith(".localhost") or name in self.hosts:
            return None
        if not self.hosts and (not self.local or name == self.own):
            return None
        answers = "localhost, IP addresses" + "".join(f", {h}" for h in sorted(self.hosts))
        return (f"requests for host '{name}' are refused: this server answers to {answers} (start it with "
                f"--allowed-hosts {name} to answer to that name)")

    def cross_origin(self, origin: str | None, host: str | None) -> bool | None:
        """None: no Origin or the server's own; True: another origin it allows; False: another it refuses."""
        if origin is None:
            return None
        parts = urlsplit(origin)
        if host is not None and parts.scheme in DEFAULT_PORTS and parts.netloc and (
                authority(parts.scheme, parts.netloc) == authority(parts.scheme, host)):
            return None
        return "*" in self.origins or origin.strip().rstrip("/").lower() in self.origins

    @staticmethod
    def origin_refusal(origin: str) -> str:
        return (f"cross-origin request from {origin} refused: only the server's own page may call it from a browser "
                f"(start it with --allowed-origins {origin} to allow that origin)")


class Guard:
    """The ASGI middleware: refusals first, CORS for allowed origins, every response counted."""

    def __init__(self, app, state):
        self.app, self.state, self.rules = app, state, Rules(state.settings)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        origin, host = headers.get("origin"), headers.get("host")
        refusal = self.rules.host_refusal(host)
        cross = self.rules.cross_origin(origin, host)
        if refusal is None and cross is False:
            refusal = self.rules.origin_refusal(origin)
        status = []

        async def answer(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                if cross and refusal is None:
                    message = {**message, "headers": [*message.get("headers", []), *cors(origin)]}
            await send(message)

        try:
            if refusal is not None:
                await error_response(APIError(403, refusal))(scope, receive, answer)
            elif cross and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                await preflight(headers)(scope, receive, answer)
            else:
                await self.app(scope, receive, answer)
        except Exception as exc:
            if status:  # the answer had begun (a stream): uvicorn ends the connection
                raise
            # answered here, not re-raised to Starlette's outermost middleware: uvicorn closes a connection whose
            # app raised, and the client's next request on it was reset
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            await error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))(scope, receive,
                                                                                                   answer)
        finally:
            if status:
                route = scope.get("route")
                self.state.responded(getattr(route, "path", "none"), scope["method"], status[0])


def cors(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
            (b"access-control-expose-headers", EXPOSED.encode())]


def preflight(headers: Headers):
    """The answer to an allowed origin's CORS preflight (the actual request gets `cors` headers)."""
    from starlette.responses import Response

    asked = headers.get("access-control-request-headers", "")
    allowed = ", ".join(sorted({"authorization", "content-type", *(h.strip().lower() for h in asked.split(",")
                                                                     if h.strip())}))
    return Response(status_code=204, headers={"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                                              "Access-Control-Allow-Headers": allowed,
                                              "Access-Control-Max-Age": "600"})
