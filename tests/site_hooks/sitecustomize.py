"""Imported at start-up by every Python process that has this folder on PYTHONPATH (child processes included), for
tests that need a machine this one is not:

- $MIRROR_RT_TEST_CRASH: OpenVINO GenAI's pipelines die of SIGFPE, as its ContinuousBatchingPipeline does at 1 thread
  and bf16 on a Xeon with AMX. `build`: when a pipeline is built; `generate`: when it first generates (LLMPipeline's
  generate, ContinuousBatchingPipeline's step).
- $MIRROR_RT_TEST_HIDE: comma-separated top-level modules that import as if not installed (an extra left out).
"""

import importlib.abc
import importlib.util
import os
import signal
import sys

STAGE = os.environ.get("MIRROR_RT_TEST_CRASH")
HIDDEN = {name for name in os.environ.get("MIRROR_RT_TEST_HIDE", "").split(",") if name}
PIPELINES = {"LLMPipeline": "generate", "ContinuousBatchingPipeline": "step"}


def _die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGFPE)


def _crashing(module) -> None:
    for name, method in PIPELINES.items():
        real = getattr(module, name)
        setattr(module, name, _die if STAGE == "build" else type(name, (real,), {method: _die}))


class _Finder(importlib.abc.MetaPathFinder):
    """Hides the HIDDEN modules; finds openvino_genai as usual, then has its loader swap in dying pipelines."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        if name != "openvino_genai" or STAGE not in ("build", "generate"):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _crashing(module)

        spec.loader.exec_module = exec_module
        return spec


if STAGE or HIDDEN:
    sys.meta_path.insert(0, _Finder())
