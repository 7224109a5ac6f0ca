"""Torch target split at the early-exit layer: prefix (layers < exit) and suffix (the rest).

`forward_prefix` returns per position the early exit's top-kappa ids and log-probs (the target's own head on the
exit hidden state, after an `ExitAdapter` when given: it moves which branches are drafted, never the output);
`launch_prefix` queues it, so a CUDA target queues its suffix before anything is read back. The hidden state stays
on the device until `forward_suffix`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from mirror_rt.devices.torch.backend import TorchModel
from mirror_rt.models.config import SplitConfig
from mirror_rt.models.exit_adapter import cached_exit_logits, check_compatible
from mirror_rt.runtime.transfer import PendingRead


class TorchSplitTarget(TorchModel):
    """A torch target with an early exit after layer `exit_layer` (a count of layers; None: SplitConfig's default)."""

    def __init__(self, model, exit_layer: int | None = None, kappa: int | None = None, device: str = "cpu",
                 exit_adapter=None, compile: bool = False, static: bool = False):
        super().__init__(model, device, compile, static)
        # a CUDA target computes while the host goes on: Mirror queues its suffix before reading the exit back
        self.capabilities = replace(self.capabilities, split=True, asynchronous=self.device.type == "cuda",
                                    split_rows=self.capabilities.rows)
        self.exit_layer, self.kappa = SplitConfig(exit_layer, kappa).resolve(model.config)
        if exit_adapter is not None:
            check_compatible(exit_adapter, model, self.exit_layer)
            p = self.model.embed_tokens.weight
            exit_adapter = exit_adapter.to(device=p.device, dtype=p.dtype).eval()
        self.exit_adapter = exit_adapter  # models.exit_adapter.ExitAdapter or None (untrained exit)

    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """Prefix and suffix: every static window runs as both (`forward`), at each size."""
        return (0, self.exit_layer), (self.exit_layer, self.model.config.n_layers)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], cache, last_rows: int | None = None) -> torch.Tensor:
        """As `TorchModel.forward`; static windows run as prefix then suffix, as Mirror's do, so a compiled window
        computes a position's logits the same way in every mode."""
        if self.static is None:
            return super().forward(tokens, cache, last_rows)
        self._run_prefix(tokens, cache)
        return self.forward_suffix(cache, last_rows)

    @torch.inference_mode()
    def launch_prefix(self, tokens: Sequence[int], cache) -> PendingRead:
        """Layers 0..exit-1 over tokens [T] and the early exit, queued; `result()` -> (ids, log-probs) [T, kappa]."""
        h, rows = self._run_prefix(tokens, cache)
        last = self.exit_layer - 1  # an attention adapter reads this layer's keys (this window's rows written)
        logits = cached_exit_logits(self.model, h[:rows], self.exit_adapter, cache.keys[last], cache.values[last],
                                    cache.length)
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), self.kappa, dim=-1)
        return PendingRead(top.indices, top.values)

    def forward_prefix(self, tokens: Sequence[int], cache) -> tuple[np.ndarray, np.ndarray]:
        """Layers 0..exit-1 over tokens [T]; returns exit top-kappa ids [T, kappa] and log-probs [T, kappa]."""
        return self.launch_prefix(tokens, cache).result()

    @torch.inference_mode()
    def forward_prefix_only(self, tokens: Sequence[int], cache) -> None:
        """Layers 0..exit-1 without the early exit (when Mirror switches it off)."""
        self._run_prefix(tokens, cache)

    def _run_prefix(self, tokens: Sequence[int], cache) -> tuple[torch.Tensor, int]:
        """The prefix layers; their output waits in `cache.hidden` as (hidden, rows) until the suffix."""
        ids = self.ids(tokens)
        if self.static is None:
            h = self.model.run_layers(self.model.embed(ids), cache, 0, self.exit_layer, cache_first=0)
        else:
            h = self.static.run(ids, len(ids), cache, 0, self.exit_layer)
        cache.hidden = (h, len(ids))
        return cache.hidden

    @torch.inference_mode()
    def forward_suffix(self, cache, last_rows: int | None = None) -> torch.Tensor:
        """The remaining layers and the head over the last prefix call's window -> logits [T, vocab] (or its last
        `last_rows`), on the device."""
        if cache.hidden is None:
            raise RuntimeError("forward_suffix called without a pending forward_prefix")
        (h, rows), cache.hidden = cache.hidden, None
        n = self.model.config.n_layers
        if self.static is not None:
            logits = self.static.run(h, rows, cache, self.exit_layer, n, last_rows)
        else:
            h = self.model.run_layers(h, cache, self.exit_layer, n, cache_first=0)
            logits = self.model.logits(h if last_rows is None else h[-last_rows:])
        cache.advance(rows)
        return logits

    def forward_rows_prefix(self, tokens, pool, first: int, exits: dict[int, int]) -> tuple[list, dict]:
        """The prefix over rows first..first+B-1 (tokens [B, T]), one row a call as `forward_rows` (a row computes
        what it computes alone) -> (the rows' pending caches for `forward_rows_suffix`, {row: early exit (ids,
        log-probs) [n, kappa]} of the first n positions of each row of `exits` {row: n})."""
        caches, out = [], {}
        for r, row in enumerate(np.asarray(tokens).tolist()):
            cache = pool.row_cache(first + r)
            if r in exits:
                ids, logprobs = self.forward_prefix(row, cache)
                out[r] = (ids[:exits[r]], logprobs[:exits[r]])
            else:
                self.forward_prefix_only(row, cache)
            caches.append(cache)
        return caches, out

    def forward_rows_suffix(self, caches: list, pool, first: int) -> torch.Tensor:
        """The suffix over the rows `forward_rows_prefix` ran -> logits [B, T, vocab]; no advance (the caller
        commits)."""
        lengths = [cache.length for cache in caches]
        logits = torch.stack([self.forward_suffix(cache) for cache in caches])
        for r, length in enumerate(lengths):
            pool.commit(first + r, length)
        return logits
