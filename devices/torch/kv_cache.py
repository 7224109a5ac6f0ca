"""The torch backend's KV cache (batch 1): preallocated keys and values for a range of layers and `length`, the
positions committed. A window writes at `length..`, `advance(T)` commits it, `rollback(n)` moves `length` back (O(1)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mirror_rt.devices.base import CacheBounds
from mirror_rt.runtime.transfer import import_torch

if TYPE_CHECKING:
    import torch


class KVCache(CacheBounds):
    """Keys and values for `n_layers` layers (indices local to the cache), `capacity` positions each."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu", slots: int | None = None):
        torch = import_torch()
        dtype = torch.float32 if dtype is None else dtype
        shape = (n_layers, n_kv_heads, max(capacity, slots or 0), head_dim)  # [layers, kv_heads, slots, head_dim]
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0
        self.hidden = None  # a split target's prefix output waiting for its suffix (the backend's own object)

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> KVCache:
        """An empty cache over existing storage [layers, kv_heads, slots >= capacity, head_dim] (reused buffers:
        a compiled model's caches keep their addresses, which CUDA graphs require)."""
        cache = cls.__new__(cls)
        cache.keys, cache.values, cache.capacity, cache.length, cache.hidden = keys, values, capacity, 0, None
        return cache

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [kv_heads, T, head_dim] at positions length.. of `layer`; returns keys, values 0..length+T-1."""
        self.check_room(k.shape[1])
        end = self.length + k.shape[1]
        self.keys[layer, :, self.length:end] = k
        self.values[layer, :, self.length:end] = v
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [kv_heads, T, head_dim] at slots `positions` [T] (a tensor on the cache's device: no host
        value sets a shape); returns every slot [kv_heads, slots, head_dim] for attention under a mask."""
        self.keys[layer].index_copy_(1, positions, k)
        self.values[layer].index_copy_(1, positions, v)
        return self.keys[layer], self.values[layer]

    def advance(self, num_positions: int) -> None:
        """Commit the positions just written by every layer."""
        self.length += num_positions

    def rollback(self, length: int) -> None:
        """Forget positions >= length (rejected drafts). O(1)."""
        self.check_rollback(length)
        self.length = length


def new_cache(model, capacity: int, first: int = 0, last: int | None = None, slots: int | None = None) -> KVCache:
    """An empty cache for layers first..last-1 of a `models.transformer.Transformer` (or a model over one: a pruned
    head, SS streams; all layers by default), in its parameters' dtype and device; `slots` >= capacity: its storage."""
    c, p = model.config, next(model.parameters())
    last = c.n_layers if last is None else last
    return KVCache(last - first, c.n_kv_heads, c.head_dim, capacity, dtype=p.dtype, device=p.device, slots=slots)
