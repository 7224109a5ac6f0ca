"""How the CLI takes Ctrl-C and SIGTERM: an exception its commands clean up on, or an exit at once.

Ctrl-C raises KeyboardInterrupt and SIGTERM `Terminated`, so `finally` blocks run (`serve` has handlers of its own).
A signal that lands during an import exits at once: raised there, the exception may cross C++ frames (torch's
pybind11 callbacks) and abort the process (exit 134). Staged `NAME.partial-PID` folders are swept by the next writer.
"""

from __future__ import annotations

import os
import signal
import sys

IMPORT_MACHINERY = "<frozen importlib._bootstrap>"
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt (exit 143 instead of 130)."""


def install(sigterm: bool = True) -> None:
    """Take Ctrl-C (unless inherited as ignored) and, with `sigterm`, SIGTERM as this module says."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_signal)
    if sigterm and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, on_signal)


def on_signal(signum, frame) -> None:
    if importing(frame):
        stop_now(signum)
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def importing(frame) -> bool:
    """Whether the main thread's stack (from `frame` down) is inside an import."""
    while frame is not None:
        if frame.f_code.co_filename == IMPORT_MACHINERY:
            return True
        frame = frame.f_back
    return False


def signal_of(exc: KeyboardInterrupt) -> int:
    return signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT


def exit_code(exc: KeyboardInterrupt) -> int:
    return EXIT_CODES[signal_of(exc)]


def say_stopped(signum: int, after_text: bool = False) -> None:
    """The one line a signal ends the CLI with (on a line of its own after an answer's partial text)."""
    sys.stdout.flush()
    word = "terminated" if signum == signal.SIGTERM else "interrupted"
    sys.stderr.write(f"{chr(10) if after_text else ''}mirror-rt: {word}\n")
    sys.stderr.flush()


def stop_now(signum: int = signal.SIGINT) -> None:
    """One line and exit at once, whatever still runs (an interpreter torn down under torch or ONNX Runtime threads
    aborts)."""
    say_stopped(signum)
    os._exit(EXIT_CODES[signum])


def start() -> int:
    """The command line: its modules imported under a Ctrl-C guard, then `dispatch.main` under its own."""
    install(sigterm="serve" not in sys.argv[1:2])  # serve drains on SIGTERM, with its own handlers
    try:
        from mirror_rt.cli.dispatch import main
    except KeyboardInterrupt as exc:
        stop_now(signal_of(exc))
    return main()
