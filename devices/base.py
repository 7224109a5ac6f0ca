"""What the backends share: the cache checks (`CacheBounds`) and the split target's verbs (`SplitTarget`).

The boundary itself (what the runtime asks of a loaded model, and the `Capabilities` a backend declares for it)
is runtime.backend; the backends (torch, OpenVINO, ONNX Runtime) implement it, and the runtime imports none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mirror_rt.runtime.backend import CacheFull


class CacheBounds:
    """Checks shared by backend caches (subclasses provide `length` and `capacity`)."""

    def check_room(self, num_tokens: int) -> None:
        """Raise CacheFull when `num_tokens` more positions would pass the capacity."""
        if self.length + num_tokens > self.capacity:
            raise CacheFull(f"KV cache full: {self.length + num_tokens} positions needed, "
                            f"capacity {self.capacity}")

    def check_rollback(self, length: int) -> None:
        """Raise ValueError unless 0 <= length <= self.length."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} positions")


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
