"""The `mirror-rt` command line: `dispatch` (the parser and `main`), one module per group of subcommands, the flags
they share (`options`) and signal handling (`signals`). `main`, `build_parser` and `ray_serve_app` (a RayService's
import_path) are imported on first use, so importing `mirror_rt.cli.signals` stays cheap.
"""

from __future__ import annotations

PUBLIC = ("main", "build_parser", "ray_serve_app")


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'mirror_rt.cli' has no attribute {name!r}")
    from mirror_rt.cli import dispatch

    return getattr(dispatch, name)
