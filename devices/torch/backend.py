"""Torch backend: a `models.transformer.Transformer` on cpu or cuda. Logits stay on the device (the runtime reads back
only what it decides with, runtime.transfer); with `static` (implied by `compile` and by bf16 / fp16) windows run at
fixed shapes (devices.torch.static). `TorchStreamDraft` adds a Speculative Streaming draft's stream logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from mirror_rt.devices.torch.kv_cache import KVCache, new_cache
from mirror_rt.devices.torch.pool import TorchPool
from mirror_rt.devices.torch.static import StaticWindows, low_precision
from mirror_rt.models.transformer import Transformer
from mirror_rt.runtime.backend import Capabilities


class TorchModel:
    """A `LoadedModel` over a torch Transformer: rows of sequences in one call when eager, torch's thread budget."""

    def __init__(self, model: Transformer, device: str = "cpu", compile: bool = False, static: bool = False):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = model.config.max_seq_len
        # bf16 / fp16: static windows always, so every decode step has one shape (StaticWindows)
        static = compile or static or low_precision(self.model)
        self.static = StaticWindows(self.model, compile) if static else None
        self.capabilities = Capabilities(rows=self.static is None, threads=True)

    def set_threads(self, threads: int) -> int:
        """Intra-op threads for torch's work (process-wide: callers restore it); returns the previous count."""
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        return previous

    def new_cache(self, capacity: int) -> KVCache:
        capacity = min(capacity, self.max_seq_len)
        return self.static.new_cache(capacity) if self.static else new_cache(self.model, capacity)

    def can_adopt(self, target) -> bool:
        """Whether this draft's pool takes `target`'s pool rows (`TorchPool.copy_from`: a torch target)."""
        return isinstance(target, TorchModel)

    def ids(self, tokens: Sequence[int]) -> torch.Tensor:
        """Token ids [T] on the device (on CUDA from pinned memory: the copy does not wait for queued work)."""
        ids = torch.tensor(list(tokens), dtype=torch.long)
        if self.device.type != "cuda":
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], cache: KVCache, last_rows: int | None = None) -> torch.Tensor:
        """tokens [T] at positions cache.length.. -> logits [T, vocab] (or its last `last_rows`) on the device."""
        ids = self.ids(tokens)
        if self.static is None:
            return self.model(ids, cache, last_rows)
        logits = self.static.run(ids, len(ids), cache, 0, self.model.config.n_layers, last_rows)
        cache.advance(len(ids))
        return logits

    def new_pool(self, rows: int, capacity: int) -> TorchPool:
        """KV rows for `rows` sequences of up to `capacity` positions (devices.torch.pool)."""
        c, p = self.model.config, next(self.model.parameters())
        return TorchPool(c.n_layers, c.n_kv_heads, c.head_dim, rows, min(capacity, self.max_seq_len), p.dtype, p.device)

    @torch.inference_mode()
    def forward_rows(self, tokens, pool: TorchPool, first: int, last_rows: int | None = None) -> torch.Tensor:
        """tokens [B, T] at each row's length, rows first..first+B-1 -> logits [B, T or last_rows, vocab], one row a
        call (devices.torch.pool); no advance."""
        logits = []
        for r, row in enumerate(torch.as_tensor(np.asarray(tokens), dtype=torch.long).to(self.device)):
            h = self.model.run_layers(self.model.embed(row), pool.row_cache(first + r), 0, self.model.config.n_layers,
                                      cache_first=0)
            logits.append(self.model.logits(h if last_rows is None else h[-last_rows:]))
        return torch.stack(logits)

    def warm_up(self) -> None:
        """Compile the windows decoding runs (`compile`): each layer range at each window size."""
        if self.static is not None:
            self.static.warm_up([(first, last, rows) for first, last in self.layer_ranges()
                                 for rows in self.static.sizes])

    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """The (first, last) layer ranges a decode window runs through: the whole model."""
        return ((0, self.model.config.n_layers),)

    def forward_last(self, tokens: Sequence[int], cache: KVCache) -> torch.Tensor:
        """As `forward`, but logits of the last position only ([1, vocab]; prefill)."""
        return self.forward(tokens, cache, last_rows=1)


class TorchStreamDraft(TorchModel):
    """A `LoadedModel` over a StreamDraft, with `forward_streams` and `n_streams`."""

    def __init__(self, draft, device: str = "cpu"):
        super().__init__(draft.base, device)
        self.streams = draft.to(self.device).eval()
        self.n_streams = draft.n_streams
        self.capabilities = replace(self.capabilities, streams=True)

    @torch.inference_mode()
    def forward_streams(self, tokens: Sequence[int], cache) -> tuple[np.ndarray, np.ndarray]:
        """tokens [T] -> main logits [T, vocab], stream logits [T, n_s, vocab]; advances the cache by T."""
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)
        main, streams = self.streams.forward_streams(ids, cache)
        return main.float().cpu().numpy(), streams.float().cpu().numpy()
