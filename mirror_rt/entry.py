"""The `mirror-rt` console script: the CLI imported under a Ctrl-C guard.

Importing the CLI takes a few hundred milliseconds (numpy, the engine's modules); a Ctrl-C in that time is exit
130 and one line, as it is once the command runs (`mirror_rt.cli.main`), not a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    try:
        from mirror_rt.cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("\nmirror-rt: interrupted\n")
        sys.stderr.flush()
        os._exit(130)  # modules half imported: nothing to clean up, nothing to run at exit
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
