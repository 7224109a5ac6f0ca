"""`mirror-rt serve`: uvicorn over the app, one worker, with a drain on SIGTERM / Ctrl-C.

The socket opens at once and the engine loads behind it (`/health` says 503 until ready); a log
line then gives the URL, the model, the mode, the device each role got (fallbacks included) and
whether a key is required (and, without one, a line that says who can use the server). The first SIGTERM or
Ctrl-C drains: new requests get 503, requests already admitted (running or queued) finish, and whatever is left at
the deadline is cancelled; then the server stops and the process exits 0. A second signal cuts the drain short:
every open request ends at once with an error (a stream: an error event, then `[DONE]`) and the process exits
128 + the signal (143 for SIGTERM, 130 for Ctrl-C), so an orchestrator can tell it from a clean drain. A third
stops without waiting for the streams to end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time

from mirror_rt.serving.app import LOAD_THREAD, ServerState, create_app
from mirror_rt.serving.errors import json_errors_protocol
from mirror_rt.serving.settings import ServerConfig

log = logging.getLogger("mirror_rt.serve")


def configure_logging() -> None:
    """`mirror-rt serve: ...` lines on stderr (access log included)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("mirror-rt serve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def describe(state: ServerState, url: str) -> str:
    """The start-up line: where, what, how, on which devices, and whether a key is required."""
    engine, settings = state.engine, state.settings
    fallbacks = engine.placement.fallbacks if engine.placement is not None else {}
    roles = []
    for role in ("target", "draft"):
        device = engine.names.get(f"{role}_device", "?")
        note = f" (asked for {fallbacks[role]}: not available, fell back)" if role in fallbacks else ""
        roles.append(f"{role} on {device}{note}")
    key = "API key required" if settings.api_key else "no API key"
    return (f"serving {state.model_name} at {url}/v1 ({engine.names.get('path', 'engine')}), mode "
            f"{state.default_mode}, {', '.join(roles)}; {engine.decoder.describe()}; {key}; "
            f"queue {settings.max_queued}")


def open_to(settings: ServerConfig, url: str) -> str:
    """The line that says who may use a server without an API key."""
    from mirror_rt.serving.guard import listens_locally

    where = "any program on this machine" if listens_locally(settings.host) else "anyone who reaches it"
    origins = ", ".join(settings.allowed_origins) or "none"
    return (f"no API key: {where} can use {url} (set --api-key or $MIRROR_RT_API_KEY to require one); browsers: "
            f"its own page and allowed origins only ({origins}: --allowed-origins)")


def quiet_cancellations(record: logging.LogRecord) -> bool:
    """Drop uvicorn's error records of a CancelledError: at a forced stop it cancels the tasks still running (the
    streams, the lifespan) and logs each with its traceback; they are the stop itself, not faults."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (isinstance(exc, asyncio.CancelledError) or str(record.msg).rstrip().endswith("CancelledError"))


class DrainingServer:
    """uvicorn.Server with a drain: the first signal stops admissions and waits for the admitted work."""

    def __init__(self, app, host: str, port: int, drain_timeout: float):
        import uvicorn

        logging.getLogger("uvicorn.error").addFilter(quiet_cancellations)
        self.server = uvicorn.Server(uvicorn_config(app, host=host, port=port, timeout_graceful_shutdown=5))
        self.server.handle_exit = self.handle_exit  # no re-raise of the signal at exit: our exit code
        self.state: ServerState = app.state.mirror
        self.drain_timeout, self.draining = drain_timeout, False
        self.exit_code = 0  # 128 + the signal that cut the drain short

    def run(self, sock=None) -> None:
        self.server.run(sockets=[sock] if sock is not None else None)

    def handle_exit(self, sig, frame) -> None:
        if self.exit_code:  # a third signal: stop now, streams or not
            self.server.force_exit = self.server.should_exit = True
        elif self.draining:
            self.exit_code = 128 + int(sig)
            threading.Thread(target=self.cut, name="mirror-cut", daemon=True).start()
        else:
            self.draining = True
            threading.Thread(target=self.drain, name="mirror-drain", daemon=True).start()

    def cut(self) -> None:
        """A second signal: every open request ends now with an error (its stream with an error event and
        [DONE]), then the server stops."""
        state = self.state
        state.status = "draining"
        log.info("a second signal: the drain is cut short; open requests end with an error")
        if state.scheduler is not None:
            cut_scheduler(state.scheduler)
        deadline = time.monotonic() + 3
        while state.open_streams and time.monotonic() < deadline:  # their last events reach the clients
            time.sleep(0.02)
        self.server.should_exit = True

    def drain(self) -> None:
        state = self.state
        state.status = "draining"
        log.info("draining: no new requests; up to %g s for the admitted ones", self.drain_timeout)
        if state.scheduler is not None:
            drain_scheduler(state.scheduler, self.drain_timeout)
        self.server.should_exit = True


def drain_scheduler(scheduler, timeout: float) -> bool:
    """Take no new job and let the admitted ones finish for up to `timeout` s, then cancel what is left (their
    streams end with an error event); True when all finished. Also what a replica runs when its server drains."""
    scheduler.close(cancel_waiting=False)
    deadline = time.monotonic() + timeout
    while not scheduler.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    finished = scheduler.idle()
    if not finished:
        log.info("drain deadline reached: cancelling what is left")
        scheduler.cancel_all()
        end = time.monotonic() + 5
        while not scheduler.idle() and time.monotonic() < end:
            time.sleep(0.05)
    time.sleep(0.2)  # the last events reach their streams
    return finished


def cut_scheduler(scheduler, grace: float = 1.0) -> None:
    """Take no new job and cancel every admitted one; those the engine has not ended after `grace` s (it is inside
    a long step) end without it."""
    scheduler.close()
    scheduler.cancel_all()
    deadline = time.monotonic() + grace
    while not scheduler.idle() and time.monotonic() < deadline:
        time.sleep(0.02)
    scheduler.abandon()


def uvicorn_config(app, **options):
    """uvicorn's settings for the app (`create_app`'s): no access log, the HTTP layer's own errors in the
    envelope and counted, no WebSocket upgrade (such a request is plain HTTP: a 404 in the envelope)."""
    import uvicorn

    state = app.state.mirror
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", ws="none",
                          http=json_errors_protocol(lambda status: state.responded("none", "none", status)),
                          **options)


def serve(settings: ServerConfig, load) -> int:
    """Run the server on `settings.host`:`settings.port` until a signal drains it (up to `settings.drain_timeout`);
    returns the exit code (2 when the engine cannot load)."""
    configure_logging()
    url = f"http://{settings.host}:{settings.port}"
    sock, refused = bind_or_say(settings.host, settings.port)  # before anything loads: not uvicorn's log, exit 3
    if refused:
        print(refused, file=sys.stderr)
        return 1
    app = create_app(settings, load, log_failure=False)  # said once, on exit
    server = DrainingServer(app, settings.host, settings.port, settings.drain_timeout)
    threading.Thread(target=_announce, args=(server, url), name="mirror-announce", daemon=True).start()
    log.info("listening on %s (loading the engine; /health answers 503 until it is ready)", url)
    server.run(sock)
    _stop_engine(server.state)
    if server.state.status == "failed":
        print(f"mirror-rt: error: the engine failed to load: {server.state.error}", file=sys.stderr)
        return 2
    if any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
        # stopped while the engine loads: the interpreter must not exit under the loading thread's export or
        # ONNX Runtime session build (it aborts, exit 134); what it wrote is unfinished and swept next time
        log.info("stopped while the engine was loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    log.info("stopped" if not server.exit_code else f"stopped by a second signal (exit {server.exit_code})")
    return server.exit_code


def bind_or_say(host: str, port: int) -> tuple:
    """(a listening socket, None), or (None, the one-line error) where the machine refuses `host`:`port` (a port in
    use, an unknown host)."""
    try:
        return listening_socket(host, port), None
    except OSError as exc:
        return None, f"mirror-rt: error: cannot listen on {host}:{port}: {exc.strerror or exc}"


def listening_socket(host: str, port: int):
    """A TCP socket bound to `host`:`port` and listening, for uvicorn to serve on; OSError (socket.gaierror for
    an unknown host) when the machine refuses it."""
    import socket

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses the port
        sock.bind(address)
        sock.listen(2048)  # uvicorn's default backlog
    except OSError:
        sock.close()
        raise
    return sock


def _stop_engine(state: ServerState, timeout: float = 10.0) -> None:
    """Cancel what is left (a second signal skips the drain) and let the engine thread finish its step: an
    interpreter that exits under a running ONNX Runtime call aborts (SIGABRT) instead of exiting."""
    scheduler = state.scheduler
    if scheduler is None:
        return
    scheduler.close()
    scheduler.cancel_all()
    scheduler.thread.join(timeout)


def _announce(server: DrainingServer, url: str) -> None:
    """Log the start-up line once the engine is ready; stop the server if it failed to load."""
    state = server.state
    while state.status == "loading":
        time.sleep(0.05)
    if state.status == "failed":
        server.server.should_exit = True
    elif state.engine is not None:
        log.info(describe(state, url))
        if not state.settings.api_key:
            log.info(open_to(state.settings, url))
