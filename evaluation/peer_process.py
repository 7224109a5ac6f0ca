"""Third-party peers (OpenVINO GenAI, llama.cpp, transformers' assisted generation, our engine as a bench-serve row)
each in a child process of its own: a native library that dies (a SIGFPE inside a pipeline's constructor) ends that
process only, and the bench reports the peer as skipped with the reason instead of ending the run.

The child is spawned once per peer (a fresh interpreter: no threads or native state inherited) and builds the peer
with the builder named as `module:function`; every call (`answer`, `run_level`, `follow`) then goes over a pipe, and
the peer's log lines come back as they are written. In the parent a `RemotePeer` has the peer's public attributes
(name, label, precision...), refreshed after each call.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import multiprocessing.util  # noqa: F401 -- registers its atexit join of children first: it runs after _close_all
import pickle
import signal
from dataclasses import dataclass

_HOSTS: list[PeerHost] = []  # closed at exit, before multiprocessing joins its children (atexit runs last-in first)
PLAIN = (str, int, float, bool, type(None), dict, list, tuple)  # attribute types a RemotePeer mirrors


class PeerCrashed(RuntimeError):
    """A peer's process died (a fatal signal, an abort): the run goes on without that peer."""


@dataclass
class SkippedPeer:
    """A peer whose process died: a row of the report with its reason, never run."""

    name: str
    skipped: str  # why, in words: "its process died of SIGFPE (Floating point exception) while loading"


def death(exitcode: int | None) -> str:
    """How a child process ended, in words (a negative exit code is the signal that killed it)."""
    if exitcode is not None and exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
        except ValueError:
            return f"its process died of signal {-exitcode}"
        return f"its process died of {sig.name} ({signal.strsignal(sig)})"
    if exitcode is None:
        return "its process stopped answering"
    return f"its process exited with status {exitcode}"


class PeerHost:
    """One child process holding the peers `builder(*args, log=...)` returns (a list)."""

    def __init__(self, builder: str, args: tuple, log=print):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, builder, args), name=f"mirror-rt peer {builder}")
        self._process.start()
        child.close()
        self.log, self.dead = log, None
        _HOSTS.append(self)

    def request(self, message):
        """Send one message and wait for its answer, passing the child's log lines on; an exception the child raised
        is raised here, its death is PeerCrashed."""
        if self.dead:
            raise PeerCrashed(self.dead)
        try:
            self._conn.send(message)
            while True:
                kind, payload = self._conn.recv()
                if kind != "log":
                    break
                self.log(payload)
        except (EOFError, OSError):
            self._process.join(timeout=30)
            self.dead = death(self._process.exitcode)
            self.close()
            raise PeerCrashed(self.dead) from None
        if kind == "error":
            raise payload
        return payload

    def close(self) -> None:
        """End the child (it exits when its pipe closes)."""
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


@atexit.register
def _close_all() -> None:
    for host in _HOSTS:
        if not host._conn.closed:
            host.close()


class RemotePeer:
    """A peer living in a child process: its plain attributes here, its methods forwarded."""

    def __init__(self, host: PeerHost, index: int, described: dict):
        self._host, self._index = host, index
        self._methods = described.pop("__methods__")
        self.__dict__.update(described)

    def __getattr__(self, name: str):  # only reached for what __dict__ lacks: the peer's methods
        if name.startswith("_") or name not in self.__dict__.get("_methods", ()):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._call(name, *args, **kwargs)

    def _call(self, method: str, *args, **kwargs):
        result, described = self._host.request((self._index, method, args, kwargs))
        described.pop("__methods__")
        self.__dict__.update(described)
        return result

    def run_level(self, prompts, max_tokens: int, concurrency: int, decode=None):
        """bench-serve's closed loop in the child; `decode` (often a call to the server) runs here, on the token ids
        the child sends back as each result's text."""
        results, wall = self._call("run_level", prompts, max_tokens, concurrency, decode=list)
        for result in results:
            result.text = decode(result.text) if decode else ""
        return results, wall


def start_peers(names: list[str], builder: str, args: tuple, log=print, command: str = "bench") -> list:
    """The peers `builder(*args, log=log)` makes (for `names`), built in one child process; a SkippedPeer per name
    when that process dies while building, said in a line. An exception the builder raises is raised here."""
    host = PeerHost(builder, args, log)
    try:
        described = host.request(None)
    except PeerCrashed as exc:
        for name in names:
            log(f"{command}: skipping {name}: {exc} while loading")
        return [SkippedPeer(name, f"{exc} while loading") for name in names]
    if not described:
        host.close()
    for d in described:  # no longer beside the caller: a bench-serve row says where it ran
        if "where" in d:
            d["where"] = "own process (no HTTP)"
    return [RemotePeer(host, index, d) for index, d in enumerate(described)]


def portable_tokenizer(tokenizer):
    """What rebuilds `tokenizer` in a child: a Hugging Face tokenizer's folder (its compiled chat template does not
    pickle), else the object itself."""
    from mirror_rt.models.tokenizer import HFTokenizer

    return ("hf-folder", str(tokenizer.folder)) if isinstance(tokenizer, HFTokenizer) else tokenizer


def rebuild_tokenizer(portable):
    """The tokenizer `portable_tokenizer` described."""
    from mirror_rt.models.tokenizer import HFTokenizer

    if isinstance(portable, tuple) and portable[:1] == ("hf-folder",):
        return HFTokenizer(portable[1])
    return portable


def _serve(conn, builder: str, args: tuple) -> None:
    """The child: build the peers, describe them, then answer calls until the pipe closes."""

    def log(*parts) -> None:
        conn.send(("log", " ".join(str(p) for p in parts)))

    module, name = builder.split(":")
    try:
        conn.recv()  # the parent's first request: build
        peers = getattr(importlib.import_module(module), name)(*args, log=log)
        conn.send(("done", [_describe(p) for p in peers]))
    except EOFError:
        return
    except Exception as exc:  # noqa: BLE001 -- sent to the parent, which raises it
        conn.send(("error", _portable(exc)))
        return
    while True:
        try:
            index, method, call_args, kwargs = conn.recv()
        except EOFError:
            return
        try:
            result = getattr(peers[index], method)(*call_args, **kwargs)
            conn.send(("done", (result, _describe(peers[index]))))
        except Exception as exc:  # noqa: BLE001 -- sent to the parent, which raises it
            conn.send(("error", _portable(exc)))


def _describe(peer) -> dict:
    """The peer's public plain attributes and the names of its public methods."""
    out, methods = {}, []
    for name in dir(peer):
        if name.startswith("_"):
            continue
        value = getattr(peer, name)
        if callable(value):
            methods.append(name)
        elif isinstance(value, PLAIN):
            out[name] = value
    return out | {"__methods__": methods}


def _portable(exc: Exception) -> Exception:
    """`exc` if it survives pickling, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


ENGINE_PEER = "mirror-rt-engine"  # engine_peer.NAME


def check_serve_peers(names: list[str]) -> None:
    """ValueError naming the unknown bench-serve peers."""
    from mirror_rt.evaluation.genai_serve import PEERS

    unknown = [n for n in names if n not in (ENGINE_PEER, *PEERS)]
    if unknown:
        raise ValueError(f"unknown bench-serve peer(s): {', '.join(unknown)} (known: "
                         f"{', '.join((ENGINE_PEER, *PEERS))})")


def serve_peers(names: list[str], model: str | None, threads: int, cache: str | None = None, log=print) -> list:
    """bench-serve's peers, in the order named, each built in a child process of its own (a SkippedPeer where that
    process died); unknown names are refused before any starts."""
    check_serve_peers(names)
    peers = []
    for name in names:
        if name == ENGINE_PEER:
            peers += start_peers([name], "mirror_rt.evaluation.engine_peer:engine_peers", (cache,), log, "bench-serve")
        else:
            peers += start_peers([name], "mirror_rt.evaluation.genai_serve:load_peers", ([name], model, threads, cache),
                                 log, "bench-serve")
    return peers
