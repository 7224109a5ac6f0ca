"""The `mirror-rt` console script: the CLI imported under a Ctrl-C guard.

Importing the CLI takes a few hundred milliseconds (numpy, the engine's modules); a Ctrl-C in that time is exit
130 and one line, as it is once the command runs (`mirror_rt.cli.main`), not a KeyboardInterrupt traceback.
A Ctrl-C that lands while any module is being imported (torch and ONNX Runtime load lazily, inside commands)
exits at once: raised there, the KeyboardInterrupt may cross C++ frames (torch's initialisation calls back into
Python through pybind11) and abort the process ('terminate called ... KeyboardInterrupt', exit 134). Anything
staged by then is a `NAME.partial-PID` folder, swept by the next writer (`models.partials`).
"""

from __future__ import annotations

import os
import signal
import sys

IMPORT_MACHINERY = "<frozen importlib._bootstrap>"


def main() -> int:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an inherited SIG_IGN stays ignored
        signal.signal(signal.SIGINT, on_sigint)
    try:
        from mirror_rt.cli import main as cli_main
    except KeyboardInterrupt:
        interrupted()
    return cli_main()


def on_sigint(signum, frame) -> None:
    """Ctrl-C: exit at once inside an import, a KeyboardInterrupt anywhere else (commands clean up on it)."""
    if importing(frame):
        interrupted()
    raise KeyboardInterrupt


def importing(frame) -> bool:
    """Whether the main thread's stack (from `frame` down) is inside an import."""
    while frame is not None:
        if frame.f_code.co_filename == IMPORT_MACHINERY:
            return True
        frame = frame.f_back
    return False


def interrupted() -> None:
    sys.stdout.flush()
    sys.stderr.write("\nmirror-rt: interrupted\n")
    sys.stderr.flush()
    os._exit(130)  # modules half imported: nothing to clean up, nothing to run at exit


if __name__ == "__main__":
    sys.exit(main())
