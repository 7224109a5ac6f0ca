"""Memory this process may still take, and one-line errors that say how much a step needs and how much there is.

`available_bytes()` is the smaller of the machine's MemAvailable and what the address-space limit (ulimit -v)
leaves; `check_fits(needed, what)` refuses work that cannot fit before it starts; `out_of_memory(what, needed)`
is the error raised when an allocation failed anyway.
"""

from __future__ import annotations

import errno
import resource


class OutOfMemory(MemoryError):
    """A step that needs more memory than there is (one line: what, how much it needs, how much there is)."""


def available_bytes() -> int | None:
    """Bytes this process may still allocate: MemAvailable, within the address-space limit; None where unknown."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        found.append(int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit not in (resource.RLIM_INFINITY, -1):
        found.append(max(0, limit - _address_space()))
    return min(found) if found else None


def address_space_left() -> int | None:
    """Bytes of address space the limit (ulimit -v, prlimit --as) leaves this process; None without a limit."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit in (resource.RLIM_INFINITY, -1):
        return None
    return max(0, limit - _address_space())


def _address_space() -> int:
    try:
        with open("/proc/self/status") as f:
            size = next(line for line in f if line.startswith("VmSize:"))
        return int(size.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 0


def gigabytes(n: int) -> str:
    """Bytes in GiB (2**30 bytes), the unit the start-up lines and --kv-cache-gb use."""
    return f"{n / 2**30:.2f} GiB" if n < 10 * 2**30 else f"{n / 2**30:.1f} GiB"


def out_of_memory(what: str, needed: int | None = None) -> OutOfMemory:
    """The error of a step that could not allocate: `what` ("loading x in torch at float32"), its need."""
    available = available_bytes()
    need = f" needs {gigabytes(needed)}" if needed else " needs more memory"
    there = f", {gigabytes(available)} available" if available is not None else ""
    return OutOfMemory(f"out of memory: {what}{need}{there}")


def check_fits(needed: int, what: str, margin: float = 1.05) -> None:
    """OutOfMemory before a step that cannot fit in what this process may still allocate."""
    available = available_bytes()
    if available is not None and needed * margin > available:
        raise out_of_memory(what, needed)


def out_of_memory_error(exc: BaseException) -> bool:
    """Whether `exc` is the machine refusing memory (MemoryError, ENOMEM; a wrapped one too), not a bad input."""
    while exc is not None:
        if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
