"""Thread placement: pin the calling thread to cores, and put it back. A failure to pin never stops decoding.

Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor


def available_cores() -> set[int]:
    """The cores this process may run on (every core where the platform cannot say)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def pin(cores: int | Iterable[int] | None) -> set[int] | None:
    """Pin the calling thread to `cores` (one core or several); returns the previous mask for
    `restore`, or None when nothing changed (None given, no support, or refused)."""
    if cores is None or not hasattr(os, "sched_setaffinity"):
        return None
    wanted = {cores} if isinstance(cores, int) else set(cores)
    if not wanted:
        return None
    previous = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, wanted)
    except OSError:
        return None
    return previous


def restore(previous: set[int] | None) -> None:
    """Undo `pin` (a None from `pin` undoes nothing)."""
    if previous is not None:
        os.sched_setaffinity(0, previous)


@contextlib.contextmanager
def placed(model, cores: int | Iterable[int] | None):
    """The calling thread pinned to `cores` (one core, or a worker's set of cores: devices.placement), and `model`'s
    work (a backend with a thread budget of its own: `Capabilities.threads`) on a thread per core, while the block
    runs; both put back after. None: as they are."""
    if cores is None:
        yield
        return
    count = 1 if isinstance(cores, int) else len(set(cores))
    previous = pin(cores)
    threads = model.set_threads(count) if model.capabilities.threads else None
    try:
        yield
    finally:
        if threads is not None:
            model.set_threads(threads)
        restore(previous)


_helpers: dict = {}  # core(s) -> the one-thread executor pinned to them (two calls at once)


def on_two_cores(first, second, cpus: tuple) -> tuple:
    """(first(), second()) at once: first() here pinned to cpus[0], second() in a helper thread pinned to cpus[1];
    both waited for, even when first() fails (both may write into one pool)."""
    helper = _helpers.get(cpus[1])
    if helper is None:
        helper = _helpers[cpus[1]] = ThreadPoolExecutor(1, thread_name_prefix="mirror-rows", initializer=pin,
                                                        initargs=(cpus[1],))
    later = helper.submit(second)
    previous = pin(cpus[0])
    try:
        head = first()
    finally:
        restore(previous)
        tail = later.result()
    return head, tail
