"""The device boundary: what the runtime may ask of a loaded model.

A `LoadedModel` owns its weights on some device and makes KV caches for itself; the
runtime hands it token ids and gets host-side logits back as numpy arrays, so no backend
tensor ever crosses into the runtime. Backends (torch, OpenVINO, ONNX Runtime) implement
this protocol; the runtime core imports none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Cache(Protocol):
    """A KV cache the model made for itself."""

    length: int  # positions committed so far
    capacity: int  # maximum positions

    def rollback(self, length: int) -> None: ...  # forget positions >= length


def pin_thread(cpu: int | None) -> None:
    """Pin the calling thread to one core (Linux; a no-op elsewhere or for None)."""
    import os

    if cpu is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:
            pass


class CacheBounds:
    """Checks shared by backend caches (subclasses provide `length` and `capacity`)."""

    def check_room(self, num_tokens: int) -> None:
        """Raise CacheFull when `num_tokens` more positions would pass the capacity."""
        from mirror_rt.runtime.kv_cache import CacheFull

        if self.length + num_tokens > self.capacity:
            raise CacheFull(f"KV cache full: {self.length + num_tokens} positions needed, "
                            f"capacity {self.capacity}")

    def check_rollback(self, length: int) -> None:
        """Raise ValueError unless 0 <= length <= self.length."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} positions")


class LoadedModel(Protocol):
    """A model ready to run on one device.

    Optional capabilities the runtime uses where a backend has them (looked up with getattr):
    - `forward_last(tokens, cache)`: as `forward`, logits of the last position only ([1, vocab]; prefill);
    - `adopt(target_cache, capacity)`: a new cache holding a target cache's positions, for a draft that is
      the target at another precision (`same_model_as_target`, set by the bundle loaders);
    - `prefill_pipelined(tokens, cache, cpu)` on split targets: the prompt over this core and `cpu`.
    """

    vocab_size: int  # rows of the logits
    max_seq_len: int  # context limit of the model

    def new_cache(self, capacity: int) -> Cache: ...

    def forward(self, tokens: Sequence[int], cache: Cache) -> np.ndarray:
        """tokens [T] at positions cache.length.. -> logits [T, vocab]; advances the cache by T."""
        ...
