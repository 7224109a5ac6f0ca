"""`mirror-rt serve`: uvicorn over the app, one worker, with a drain on SIGTERM / Ctrl-C.

The socket opens at once and the engine loads behind it (`/health` says 503 until ready). The first signal
drains: new requests get 503, admitted ones finish, what is left at the deadline is cancelled; exit 0. A second
ends every open request at once with an error (a stream: an error event, then `[DONE]`) and exits 128 + the signal;
a third stops without waiting for the streams to end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
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
    roles = [f"{role} on {engine.names.get(f'{role}_device', '?')}"
             + (f" (asked for {fallbacks[role]}: not available, fell back)" if role in fallbacks else "")
             for role in ("target", "draft")]
    key = "API key required" if settings.api_key else "no API key"
    return (f"serving {state.model_name} at {url}/v1 ({engine.names.get('path', 'engine')}), mode "
            f"{state.default_mode}, {', '.join(roles)}; {context_line(state)}; {engine.decoder.describe()}; {key}; "
            f"queue {settings.max_queued}")


def context_line(state: ServerState) -> str:
    """The context a request gets; where the KV budget holds less than the model's, how much and what to set."""
    model = state.engine.target.max_seq_len
    if state.context >= model:
        return f"context {model} tokens"
    return (f"context {state.context} tokens, not the model's {model}: the KV budget holds no more (requests "
            f"without max_tokens stop there; raise --kv-cache-gb for the whole context)")


def open_to(settings: ServerConfig, url: str) -> str:
    """The line that says who may use a server without an API key."""
    from mirror_rt.serving.guard import listens_locally

    where = "any program on this machine" if listens_locally(settings.host) else "anyone who reaches it"
    origins = ", ".join(settings.allowed_origins) or "none"
    return (f"no API key: {where} can use {url} (set --api-key or $MIRROR_RT_API_KEY to require one); browsers: "
            f"its own page and allowed origins only ({origins}: --allowed-origins)")


def page_line(settings: ServerConfig) -> str:
    """The line giving the playground page's URL (a wildcard address is not one to browse: this machine's is)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(settings.host, settings.host)
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"playground: open http://{host}:{settings.port}/ in a browser (a chat page on this server; --no-ui: none)"


def quiet_cancellations(record: logging.LogRecord) -> bool:
    """Drop uvicorn's error records of a CancelledError: a forced stop cancels the running tasks, not a fault."""
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
        """A second signal: every open request ends now with an error, then the server stops."""
        state = self.state
        state.status = "draining"
        log.info("a second signal: the drain is cut short; open requests end with an error")
        if state.scheduler is not None:  # those the engine has not ended after 1 s (a long step) end without it
            state.scheduler.close()
            state.scheduler.cancel_all()
            _wait_idle(state.scheduler, 1.0, 0.02)
            state.scheduler.abandon()
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
    """Take no new job, let the admitted ones finish for up to `timeout` s, then cancel what is left; True when
    all finished. Also what a replica runs when its server drains."""
    scheduler.close(cancel_waiting=False)
    finished = _wait_idle(scheduler, timeout)
    if not finished:
        log.info("drain deadline reached: cancelling what is left")
        scheduler.cancel_all()
        _wait_idle(scheduler, 5)
    time.sleep(0.2)  # the last events reach their streams
    return finished


def _wait_idle(scheduler, seconds: float, poll: float = 0.05) -> bool:
    """Wait up to `seconds` for the scheduler to hold no job; whether it is idle."""
    deadline = time.monotonic() + seconds
    while not scheduler.idle() and time.monotonic() < deadline:
        time.sleep(poll)
    return scheduler.idle()


def uvicorn_config(app, **options):
    """uvicorn's settings for `create_app`'s app: no access log, the HTTP layer's errors enveloped and counted,
    no WebSocket upgrade (a plain 404)."""
    import uvicorn

    state = app.state.mirror
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", ws="none",
                          http=json_errors_protocol(lambda status: state.responded("none", "none", status)),
                          **options)


def serve(settings: ServerConfig, load) -> int:
    """Serve until a signal drains the server; returns the exit code (2 when the engine cannot load)."""
    configure_logging()
    url = f"http://{settings.host}:{settings.port}"
    sock, refused = bind_or_say(settings.host, settings.port)  # before anything loads: not uvicorn's log, exit 3
    if refused:
        print(refused, file=sys.stderr)
        return 1
    app = create_app(settings, load, log_failure=False)  # said once, on exit
    server = DrainingServer(app, settings.host, settings.port, settings.drain_timeout)
    threading.Thread(target=_announce, args=(server, url), name="mirror-announce", daemon=True).start()
    if threading.current_thread() is threading.main_thread():  # a signal before uvicorn takes them drains as after
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, server.handle_exit)
    log.info("listening on %s (loading the engine; /health answers 503 until it is ready)", url)
    server.server.run(sockets=[sock])
    _stop_engine(server.state)
    if server.state.status == "failed":
        print(f"mirror-rt: error: the engine failed to load: {server.state.error}", file=sys.stderr)
        return 2
    if any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
        # the interpreter must not exit under the loading thread's export or ONNX Runtime build (it aborts)
        log.info("stopped while the engine was loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    log.info("stopped" if not server.exit_code else f"stopped by a second signal (exit {server.exit_code})")
    return server.exit_code


def bind_or_say(host: str, port: int) -> tuple:
    """(a listening TCP socket, None), or (None, the one-line error) where the machine refuses `host`:`port`."""
    import socket

    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses the port
        sock.bind(address)
        sock.listen(2048)  # uvicorn's default backlog
        return sock, None
    except OSError as exc:
        if sock is not None:
            sock.close()
        return None, f"mirror-rt: error: cannot listen on {host}:{port}: {exc.strerror or exc}"


def _stop_engine(state: ServerState, timeout: float = 10.0) -> None:
    """Cancel what is left and let the engine thread finish its step (exiting under an ONNX Runtime call aborts)."""
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
        if state.settings.ui:
            log.info(page_line(state.settings))
        if not state.settings.api_key:
            log.info(open_to(state.settings, url))
