"""Static-shape windows of a torch Transformer, optionally compiled (`--compile`).

A window runs padded to 1 or VERIFY_ROWS rows (longer ones, prompts, run the same layout eagerly, unpadded); padding
rows write KV slots nothing commits and their outputs are dropped. KV is written at device-side positions and
attention reads every slot under a device-built mask, so a compiled window has one shape per size (CUDA graphs on
CUDA, inductor on the CPU; compiled code is also specialized on torch's thread count). Caches come from a pool of
storages of a power-of-two slot count (a symbolic size: a new one records a CUDA graph without compiling); each
serves one live cache and returns to the pool when that cache is dropped.
"""

from __future__ import annotations

import weakref

import torch

from mirror_rt.devices.torch.kv_cache import KVCache
from mirror_rt.models.transformer import MAX_PAD, Transformer
from mirror_rt.runtime.backend import CacheFull

VERIFY_ROWS = 8  # the verify window's padded length: gamma + 1 <= 8 (gamma <= 7)
WINDOW_SIZES = (1, VERIFY_ROWS)  # padded window lengths; longer windows (prompts) run eagerly, unpadded
INVARIANT_SIZES = (VERIFY_ROWS,)  # bf16 / fp16: every decode step at one shape (see StaticWindows)
MIN_SLOTS = 256  # smallest storage (slots): short requests share one size


def window_size(rows: int, sizes: tuple[int, ...] = WINDOW_SIZES) -> int | None:
    """The padded length of a window of `rows` rows, or None (a prompt: run unpadded)."""
    return next((size for size in sizes if size >= rows), None)


def low_precision(model: Transformer) -> bool:
    """Whether the model computes in bf16 / fp16, whose matrix products round differently at different row counts."""
    return model.embed_tokens.weight.dtype in (torch.bfloat16, torch.float16)


class StaticWindows:
    """Static-shape forwards of one model on its device, compiled or eager, with their cache pool.

    A bf16 / fp16 model runs every decode step at VERIFY_ROWS rows, one-token steps included: it rounds a row
    differently at another row count, and at one shape a position's logits are the same in every mode (lossless
    speculation at the target's precision); fp32 keeps its one-row steps.
    """

    def __init__(self, model: Transformer, compile: bool = False):
        self.model = model
        self.sizes = INVARIANT_SIZES if low_precision(model) else WINDOW_SIZES
        self.compiled = None
        if compile:
            cuda = model.embed_tokens.weight.device.type == "cuda"
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self.compiled = torch.compile(model.window_at, mode="reduce-overhead" if cuda else None,
                                          fullgraph=True)  # window rows static (mark_static), slots symbolic
        self.free: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # storages by slot count
        self.sizes_run: set[tuple[int, int, int]] = set()  # (first, last, size) windows run so far

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache of `capacity` positions over a pooled storage (power-of-two slots + padding room)."""
        slots = max(MIN_SLOTS, 1 << (capacity - 1).bit_length()) + MAX_PAD
        free = self.free.setdefault(slots, [])
        keys, values = free.pop() if free else self._storage(slots)
        cache = KVCache.over(keys, values, capacity)
        weakref.finalize(cache, free.append, (keys, values))  # the storage returns when the cache is dropped
        self.model.ensure_rope(slots)
        return cache

    def _storage(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        c, p = self.model.config, self.model.embed_tokens.weight
        keys, values = (torch.zeros(c.n_layers, c.n_kv_heads, slots, c.head_dim, dtype=p.dtype, device=p.device)
                        for _ in range(2))
        if self.compiled is not None:
            # no copy per call (CUDA graphs read it in place; another storage re-records, it never recompiles)
            # and any slot count (a symbolic size of the compiled code)
            for storage in (keys, values):
                torch._dynamo.mark_static_address(storage, guard=False)
                torch._dynamo.mark_dynamic(storage, 2)
        return keys, values

    def warm_up(self, windows: list[tuple[int, int, int]]) -> None:
        """Compile (and record) windows before the first request: (first layer, last layer, rows) each."""
        if self.compiled is None:
            return
        p = self.model.embed_tokens.weight
        cache = self.new_cache(MIN_SLOTS)  # a scratch cache: nothing is committed
        with torch.inference_mode():
            for first, last, rows in windows:
                x = torch.zeros(rows, dtype=torch.long, device=p.device) if first == 0 else \
                    torch.zeros(rows, self.model.config.hidden_size, dtype=p.dtype, device=p.device)
                self.run(x, rows, cache, first, last)

    def run(self, x: torch.Tensor, rows: int, cache: KVCache, first: int, last: int,
            last_rows: int | None = None) -> torch.Tensor:
        """Layers first..last-1 over `rows` positions at cache.length.. (no advance) of x: token ids [rows] (first 0)
        or what the window's prefix returned. Returns hidden rows (padded: the suffix takes them as they are), or
        the real rows' logits [rows or last_rows, vocab] when `last` is the last layer."""
        start = cache.length
        if start + rows > cache.capacity:
            raise CacheFull(f"KV cache full: {start + rows} positions needed, capacity {cache.capacity}")
        size = window_size(rows, self.sizes)
        if size is None:  # a prompt (or a gamma > 7 window): the same layout, eager and unpadded
            positions = torch.arange(start, start + rows, device=x.device)
            return self.model.window_at(x, positions, cache, first, last, head_rows=last_rows)
        if first == 0 and size > rows:
            x = torch.cat([x, x.new_zeros(size - rows)])  # padding ids: their rows are dropped
        positions = torch.arange(start, start + size, device=x.device)
        self.sizes_run.add((first, last, size))
        if self.compiled is not None:
            if first == 0:  # a new window: the previous window's graph outputs are dead (a suffix reads its prefix's)
                torch.compiler.cudagraph_mark_step_begin()
            torch._dynamo.mark_static(x, 0)  # one graph per window size, never a symbolic row count
            torch._dynamo.mark_static(positions, 0)
            if last == self.model.config.n_layers:
                self.model.refresh_head()  # the fp32 LM head copy a compiled window reads (made eagerly)
        out = (self.compiled or self.model.window_at)(x, positions, cache, first, last)
        if last < self.model.config.n_layers:
            return out
        return out[rows - last_rows:rows] if last_rows else out[:rows]
