"""torch, imported where a tensor is made: the host-array path (ONNX Runtime, OpenVINO) never imports it.

Importing torch takes about a second, most of a cold `mirror-rt run` over the default bundle, whose graphs
give numpy arrays and decode greedily without it. Runtime modules take torch from `import_torch()` inside
the functions that make tensors (sampled draws, logit processing) and ask `is_tensor` whether a model output
is one. A worker's torch thread count asked for before torch is imported (`set_threads`) is applied when it is.
"""

from __future__ import annotations

import sys

_pending_threads: int | None = None


def is_tensor(x) -> bool:
    """Whether `x` is a torch tensor; never imports torch (before torch is imported, nothing is one). Safe while
    another thread imports it: a module without `Tensor` yet has made no tensor."""
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return tensor is not None and isinstance(x, tensor)


def set_threads(count: int) -> None:
    """torch's intra-op threads (process-wide): set now where torch is imported, else when `import_torch` is."""
    global _pending_threads
    set_num_threads = getattr(sys.modules.get("torch"), "set_num_threads", None)
    if set_num_threads is None:  # not imported (or being imported): the next import_torch() applies it
        _pending_threads = count
    else:
        _pending_threads = None
        set_num_threads(count)


def import_torch():
    """The torch module, imported on first use with the thread count `set_threads` asked for."""
    global _pending_threads
    import torch

    if _pending_threads is not None:
        torch.set_num_threads(_pending_threads)
        _pending_threads = None
    return torch
