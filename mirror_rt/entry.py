"""The `mirror-rt` console script: the CLI imported under a Ctrl-C guard (`signals.start`): exit 130, one line."""

from __future__ import annotations

import sys

from mirror_rt.cli.signals import start as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
