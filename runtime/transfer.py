"""The device boundary, counted: everything a decoder reads back from a model's output tensors.

The runtime reads outputs only through `to_host` / `host_ids` / `host_floats` / `PendingRead`, which count the
bytes and reads of tensors on an accelerator, per thread; `record_shapes` keeps every tensor read's shape, CPU
included. torch is imported only where a tensor is made (`import_torch`).
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class _Counters(threading.local):
    """Per thread: bytes and reads from accelerators, and the shapes `record_shapes` collects (None: not now)."""

    bytes = 0
    reads = 0
    shapes: list | None = None


_local = _Counters()


def counters() -> tuple[int, int]:
    """(bytes, reads) the calling thread read back from accelerators so far."""
    return _local.bytes, _local.reads


def _count(tensor: torch.Tensor, sync: bool = True) -> None:
    """Count one tensor read; `sync`: it waits for the device (copies completed together count one)."""
    if tensor.device.type != "cpu":
        _local.bytes += tensor.numel() * tensor.element_size()
        _local.reads += sync
    if _local.shapes is not None:
        _local.shapes.append((tuple(tensor.shape), str(tensor.device)))


def to_host(x) -> np.ndarray:
    """A model output as a host array (counted when it is a tensor)."""
    if not is_tensor(x):
        return np.asarray(x)
    _count(x)
    return x.detach().cpu().numpy()


def host_ids(x, count: bool = True) -> list[int]:
    """Token ids [n] (a tensor or an array) as Python ints; `count=False`: a tensor made from host arrays."""
    return _host_values(x, count, int)


def host_floats(x, count: bool = True) -> list[float]:
    """A few values [n] (a tensor or an array) as Python floats (sampling: p and q at the drafted tokens)."""
    return _host_values(x, count, float)


def _host_values(x, count: bool, kind) -> list:
    if not is_tensor(x):
        return [kind(t) for t in np.asarray(x).reshape(-1)]
    if count:
        _count(x)
    return x.reshape(-1).tolist()


@contextmanager
def record_shapes():
    """Collect (shape, device) of every read in this thread while the block runs; yields the list."""
    previous = _local.shapes
    _local.shapes = shapes = []
    try:
        yield shapes
    finally:
        _local.shapes = previous


class PendingRead:
    """Tensors on their way to the host: copies are queued at once (CUDA: pinned buffers and an event), `result()`
    waits for them only. Counted when made."""

    def __init__(self, *tensors: torch.Tensor):
        self.event = None
        if tensors and is_tensor(tensors[0]) and tensors[0].device.type == "cuda":
            import torch

            self.host = []
            for i, t in enumerate(tensors):
                _count(t, sync=i == 0)  # one event: one synchronization for all of them
                self.host.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True))
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = [to_host(t) for t in tensors]

    def result(self) -> list[np.ndarray]:
        """The tensors as host arrays (waits for their copies, not for later work)."""
        if self.event is None:
            return list(self.host)
        self.event.synchronize()
        return [h.numpy() for h in self.host]


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
