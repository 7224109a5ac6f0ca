"""Zeroed buffers whose memory is committed as it is written, a small page at a time (the KV pools' storage).

A KV pool reserves every row at full capacity, so what it costs must follow what is written. numpy's zeros map
pages lazily too, but where the kernel backs anonymous memory with transparent huge pages ("always", as here),
the first write into each 2 MB stretch commits and zeroes all of it: a pool row's first prompt touched 2 MB per
layer, head and model (about 360 MB for the default model's target and draft, half a second here), before a
token was computed. These buffers ask for ordinary pages (MADV_NOHUGEPAGE) where the platform can.
"""

from __future__ import annotations

import mmap

import numpy as np


def lazy_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """A zero-filled array whose pages are committed 4 KB at a time as they are first written."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size == 0 or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, size)  # anonymous: zero-filled, committed on first write
    try:
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    except OSError:  # refused: huge pages then, as numpy's would be
        pass
    return np.frombuffer(memory, dtype=dtype).reshape(shape)  # the array keeps the mapping alive
