"""`python -m mirror_rt.cli`: the command line, as the console script runs it."""

import sys

from mirror_rt.cli.signals import start

sys.exit(start())
