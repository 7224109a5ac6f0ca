"""The device boundary: what the runtime asks of a loaded model, and what the model says it can do.

A backend declares its `Capabilities` once, when devices/ assembles it, so the runtime branches on declared fields
and never probes a model for members. Backends (devices/) implement this protocol; the runtime imports none.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class CacheFull(RuntimeError):
    """Raised when a write would pass a cache's capacity."""


@dataclass(frozen=True)
class Capabilities:
    """What a loaded model can do beyond `new_cache`, `forward` and `forward_last` (every field off by default).

    - `split`: a target split at its early exit: `forward_prefix(tokens, cache)` -> early-exit (ids, log-probs)
      [T, kappa], `forward_prefix_only`, then `forward_suffix(cache)` -> logits (Mirror);
    - `asynchronous`: `launch_prefix` queues the prefix and returns a pending read of the early exit, so a target
      that computes while the host goes on (CUDA) queues its suffix before reading anything back;
    - `rows`: `new_pool(rows, capacity)` and `forward_rows(tokens [B, T], pool, first)`: rows of many sequences
      in one call (the batched decoder's pools, runtime.batch);
    - `attention_groups`: groups of rows one `forward_rows` call attends apart (0: its rows read as one group);
    - `split_rows`: a split target's rows as prefix then suffix, `forward_rows_prefix(tokens, pool, first, exits)`
      -> (pending, {row: early exit (ids, log-probs) of its first n positions} for exits {row: n}), then
      `forward_rows_suffix(pending, pool, first)` -> logits [B, T, vocab] (Mirror's batched verify);
    - `pipelined`: `prefill_pipelined(tokens, cache, cpu)` runs a prompt on two cores (through prompt sessions of
      a thread per core where `wide`, else prefix and suffix chunks at once); `wide`: `forward_rows(..., wide=True)`
      runs rows through those sessions (a draft's: through its session over every core, for spread steps);
      `two_calls`: `forward_rows_split` and `prefill_split` run two calls at once, one per core;
    - `threads`: `set_threads(n)` sets the thread budget of the calling thread's work (torch's, process-wide);
    - `streams`: `forward_streams` adds Speculative Streaming lookahead logits (SS drafts);
    - `reads_target_rows`: a draft that is the target at another precision and whose pool takes the target pool's
      rows (`copy_from`): it starts from the target's KV instead of reading the text itself.
    """

    split: bool = False
    asynchronous: bool = False
    rows: bool = False
    attention_groups: int = 0
    split_rows: bool = False
    pipelined: bool = False
    wide: bool = False
    two_calls: bool = False
    threads: bool = False
    streams: bool = False
    reads_target_rows: bool = False


class Cache(Protocol):
    """A KV cache a model made for itself."""

    length: int  # positions committed so far
    capacity: int  # maximum positions

    def rollback(self, length: int) -> None: ...  # forget positions >= length


class LoadedModel(Protocol):
    """A model ready to run on one device."""

    vocab_size: int  # rows of the logits
    max_seq_len: int  # context limit of the model
    capabilities: Capabilities  # declared by its backend at load

    def new_cache(self, capacity: int) -> Cache: ...

    def forward(self, tokens: Sequence[int], cache: Cache):
        """tokens [T] at positions cache.length.. -> logits [T, vocab]; advances the cache by T."""
        ...

    def forward_last(self, tokens: Sequence[int], cache: Cache):
        """As `forward`, the logits of the last position only ([1, vocab]: a prompt pays for one row of the head)."""
        ...
