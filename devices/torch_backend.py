"""Torch backend: runs a `models.transformer.Transformer` on cpu or cuda.

Logits leave the device as host numpy arrays (float32 or float64), matching the other
backends; everything else (weights, KV cache) stays on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from mirror_rt.models.transformer import Transformer
from mirror_rt.runtime.kv_cache import KVCache


class TorchModel:
    """A `LoadedModel` over a torch Transformer."""

    def __init__(self, model: Transformer, device: str = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = model.config.max_seq_len

    def set_threads(self, threads: int) -> int:
        """Intra-op threads for the calling thread's torch work; returns the previous count.

        torch's setting is process-wide, so callers restore the previous value when done.
        """
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        return previous

    def new_cache(self, capacity: int) -> KVCache:
        return self.model.new_cache(min(capacity, self.max_seq_len))

    def adopt(self, target_cache: KVCache, capacity: int) -> KVCache:
        """A new cache holding `target_cache`'s committed positions (see `LoadedModel.adopt`)."""
        cache = self.new_cache(capacity)
        n = target_cache.length
        if target_cache.keys.shape[:2] != cache.keys.shape[:2] or target_cache.keys.shape[3] != cache.keys.shape[3]:
            raise ValueError("cannot adopt a cache of another shape (the draft is not a copy of the target)")
        if n > cache.capacity:
            raise ValueError(f"cannot adopt {n} positions into a cache of capacity {cache.capacity}")
        cache.keys[:, :, :n] = target_cache.keys[:, :, :n].to(cache.keys)
        cache.values[:, :, :n] = target_cache.values[:, :, :n].to(cache.values)
        cache.length = n
        return cache

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], cache: KVCache) -> np.ndarray:
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)
        logits = self.model(ids, cache)
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        return logits.cpu().numpy()
