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
      the target at another precision (`same_model_as_target`, set by the bundle loaders only where
      `can_adopt(target)` says the draft reads that target's caches: same backend and KV layout);
    - `prefill_pipelined(tokens, cache, cpu)` on split targets: the prompt over this core and `cpu`.
    """

    vocab_size: int  # rows of the logits
    max_seq_len: int  # context limit of the model

    def new_cache(self, capacity: int) -> Cache: ...

    def forward(self, tokens: Sequence[int], cache: Cache) -> np.ndarray:
        """tokens [T] at positions cache.length.. -> logits [T, vocab]; advances the cache by T."""
        ...


class SplitTarget:
    """The verbs every split target shares: prefix (with or without the early exit), suffix, forward.

    A backend subclass provides three primitives over its own graphs and cache:
    `_prefix_outputs(ids, cache)` (the prefix graph's outputs: "hidden", and "exit_hidden" when it
    computes an attention exit adapter's first stage; advances the prefix half of the cache),
    `_exit(hidden)` (the stateless exit graph: ids [T, kappa], log-probs [T, kappa]) and
    `_suffix(hidden, cache, last_rows)` (the suffix graph's logits; advances the suffix half).
    The cache carries the pending hidden state between prefix and suffix (`cache.hidden`).

    Limitations:
    - `forward_suffix` must follow each `forward_prefix` before the next prefix call.
    """

    def forward_prefix_only(self, tokens: Sequence[int], cache) -> None:
        """Layers 0..exit-1 over tokens [T], no early exit; the hidden state waits for `forward_suffix`."""
        self._run_prefix(tokens, cache)

    def _run_prefix(self, tokens: Sequence[int], cache) -> dict:
        if cache.hidden is not None:
            raise RuntimeError("forward_prefix called again before forward_suffix")
        ids = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(ids))
        out = self._prefix_outputs(ids, cache)
        cache.hidden = out["hidden"]
        return out

    def forward_prefix(self, tokens: Sequence[int], cache) -> tuple[np.ndarray, np.ndarray]:
        """Layers 0..exit-1 over tokens [T] -> early-exit (ids [T, kappa], log-probs [T, kappa])."""
        out = self._run_prefix(tokens, cache)
        return self._exit(out.get("exit_hidden", out["hidden"]))

    def forward_suffix(self, cache, last_rows: int | None = None) -> np.ndarray:
        """Layers exit..N-1 over the pending hidden state -> logits [T, vocab] (or its last `last_rows`)."""
        if cache.hidden is None:
            raise RuntimeError("forward_suffix called without a pending forward_prefix")
        hidden, cache.hidden = cache.hidden, None
        logits = self._suffix(hidden, cache, last_rows)
        return logits[-last_rows:] if last_rows else logits

    def forward(self, tokens: Sequence[int], cache) -> np.ndarray:
        """tokens [T] -> logits [T, vocab] (prefix then suffix, no early exit); advances the cache by T."""
        self.forward_prefix_only(tokens, cache)
        return self.forward_suffix(cache)

    def forward_last(self, tokens: Sequence[int], cache) -> np.ndarray:
        """As `forward`, but logits of the last position only ([1, vocab]; prefill)."""
        self.forward_prefix_only(tokens, cache)
        return self.forward_suffix(cache, last_rows=1)
