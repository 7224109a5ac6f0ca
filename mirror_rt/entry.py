"""The `mirror-rt` console script: the CLI imported under a Ctrl-C guard (`mirror_rt.cli_signals`).

Importing the CLI takes a few hundred milliseconds (numpy, the engine's modules); a Ctrl-C in that time is exit
130 and one line, as it is once the command runs (`mirror_rt.cli.main`), not a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import sys

from mirror_rt import cli_signals


def main() -> int:
    cli_signals.install(sigterm="serve" not in sys.argv[1:2])  # serve drains on SIGTERM, with its own handlers
    try:
        from mirror_rt.cli import main as cli_main
    except KeyboardInterrupt as exc:
        cli_signals.stop_now(cli_signals.signal_of(exc))
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
