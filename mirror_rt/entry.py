"""The `mirror-rt` console script: the CLI imported under a Ctrl-C guard (`mirror_rt.cli.signals.start`), so a
Ctrl-C while it loads is exit 130 and one line, as it is once the command runs, not a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import sys

from mirror_rt.cli.signals import start as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
