"""The `mirror-rt` command line: the parser of every subcommand, and dispatch.

Every user error ends as one line on stderr (`mirror-rt: error: ...`) and exit code 2; Ctrl-C exits with 130
after the committed text was printed.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from mirror_rt.cli import signals
from mirror_rt.cli.bench import COMMANDS as BENCH_COMMANDS
from mirror_rt.cli.bench import add_bench
from mirror_rt.cli.run import COMMANDS as RUN_COMMANDS
from mirror_rt.cli.run import add_commands
from mirror_rt.cli.serve import add_serve, cmd_serve, ray_serve_app
from mirror_rt.cli.training import COMMANDS as TRAINING_COMMANDS
from mirror_rt.cli.training import add_training

__all__ = ["build_parser", "main", "ray_serve_app"]  # ray_serve_app: a RayService's import_path (KubeRay)

COMMANDS = {**RUN_COMMANDS, "serve": cmd_serve, **BENCH_COMMANDS, **TRAINING_COMMANDS}


class OneLineParser(argparse.ArgumentParser):
    """A bad argument is one line too (`mirror-rt: error: ... (see mirror-rt run --help)`, exit 2), not the usage
    block; `--help` still shows the usage. Subcommands' parsers are of this class as well."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `bench --mode ar` was read as `--model ar`
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"mirror-rt: error: {message} (see {self.prog} --help)\n")


# what the machine refused (disk, memory, permissions, a file where a folder must be): a line, not a traceback
MACHINE_ERRORS = {errno.ENOSPC, errno.ENOMEM, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM, errno.ENOTDIR,
                  errno.EISDIR}


# optional packages -> the extra that installs them (pyproject.toml); None: not in an extra, named as is
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve", "starlette": "serve",
          "ray": "cluster", "playwright": "browser", "llama_cpp": "llama-cpp", "optimum": "peers", "guidellm": "load",
          "openai": None, "httpx": None}


def missing_extra(command: str, exc: ModuleNotFoundError) -> str | None:
    """The line for a missing optional package: which extra installs it (None: not an optional package)."""
    module = (exc.name or "").split(".")[0]
    if module not in EXTRAS:
        return None
    extra = EXTRAS[module]
    if extra is None:
        return f"mirror-rt {command} needs {module}, which is not installed: pip install {module}"
    return (f"mirror-rt {command} needs {module}, which the [{extra}] extra installs: pip install "
            f"\"mirror-rt[{extra}]\" (in a checkout: pip install -e \".[{extra}]\")")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mirror-rt", description="Mirror speculative decoding runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub)
    add_training(sub)
    add_bench(sub)
    add_serve(sub)
    return parser


def _one_line_warnings() -> None:
    """Device fallbacks and other runtime warnings as one line each: `mirror-rt: warning: ...`."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"mirror-rt: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show


def _exit_now(code: int) -> None:
    """Exit at once: an interpreter torn down under a worker thread inside ONNX Runtime or torch aborts."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _out_of_memory(command: str, exc: BaseException) -> int:
    """One line for an allocation the machine refused: what ran, what it needed where known, what there is."""
    from mirror_rt.models.memory import OutOfMemory, out_of_memory

    if not isinstance(exc, OutOfMemory):
        detail = str(exc).splitlines()[0] if str(exc) else "an allocation"
        exc = out_of_memory(f"{command} ({detail})")
    print(f"mirror-rt: error: {exc}", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    from mirror_rt.models.default_model import DefaultModelUnavailable

    try:
        args = build_parser().parse_args(argv)
        _one_line_warnings()
        return COMMANDS[args.command](args)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (signals.Terminated)
        signals.stop_now(signals.signal_of(exc))
    except BrokenPipeError:  # the reader went away (`| head -1`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _exit_now(141)
    except (ValueError, FileNotFoundError, DefaultModelUnavailable) as exc:
        print(f"mirror-rt: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional extra not installed: one line naming it
        line = missing_extra(args.command, exc)
        if line is None:
            raise
        print(f"mirror-rt: error: {line}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # a step that needs more than there is: one line with both figures
        return _out_of_memory(args.command, exc)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            return _out_of_memory(args.command, exc)
        if exc.errno not in MACHINE_ERRORS:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"mirror-rt: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
