"""Where the two workers run: the cores and threads of the target and the draft, chosen by device and mode.

Mirror with both on the CPU (2+ cores): each worker pinned to cores of its own (they must not contend), a thread
per core: the draft the cores its measured cost needs (`draft_share`; at least one, one where nothing was
measured), the target the rest (N-1 of N cores; 1 + 1 on two). A target on an accelerator only launches work: not
pinned, a CPU draft gets every core. `ar` / `sd`: every core for whoever runs. Pure: it reads no device, it is told
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Placement:
    """Where each worker runs: its device and compute share, and the roles that fell back."""

    target: str  # the target's device as resolved ("torch:cuda:0", "ort:cpu", ...)
    draft: str  # the draft's device as resolved
    target_cpus: tuple[int, ...] | None  # cores the target worker is pinned to (None: not pinned)
    draft_cpus: tuple[int, ...] | None  # cores the draft worker is pinned to (None: not pinned)
    target_threads: int | None  # compute threads of the target's backend (None: its default)
    draft_threads: int | None  # compute threads of the draft's backend
    # role -> the device string asked for ("cuda", "npu") where it was unusable here (a fallback warning was shown)
    fallbacks: dict[str, str] = field(default_factory=dict)

    def device(self, role: str) -> str:
        """The device `role` ("target" or "draft") runs on."""
        return {"target": self.target, "draft": self.draft}[role]

    @property
    def worker_cores(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(target cores, draft cores) when each worker is pinned to cores of its own (the engine's `cpus`), else
        None."""
        if self.target_cpus and self.draft_cpus:
            return self.target_cpus, self.draft_cpus
        return None

    @property
    def prompt_cpus(self) -> tuple[int, ...] | None:
        """Cores a pinned target's prompt may use while the draft idles: the target's and the draft's where the draft
        holds as many cores as the target (two cores: doubles the prompt's), else None (a second copy of the
        weights for a sliver more is not worth it)."""
        both = self.worker_cores
        return both[0] + both[1] if both and len(both[1]) >= len(both[0]) else None

    def describe(self) -> str:
        """`target ort:cpu, 15 threads pinned to cores 0-14; draft ort:cpu, 1 thread pinned to core 15`."""
        return f"target {_side(self.target, self.target_cpus, self.target_threads)}; " \
               f"draft {_side(self.draft, self.draft_cpus, self.draft_threads)}"


def is_accelerator(device) -> bool:
    """Whether a device (string or DeviceSpec) names something other than the CPU (`cuda`, `openvino:NPU`...)."""
    parts = str(device).lower().split(":")
    name = parts[1] if len(parts) > 1 and parts[0] in ("torch", "pt", "openvino", "ov", "ort", "onnxruntime") \
        else parts[0]
    return name not in ("cpu", "", "auto")  # auto: placed by measurement, the CPU where nothing is timed


def runs_mirror(mode: str | None) -> bool:
    """Whether an engine assembled here runs Mirror for requests in `mode` (None: its default, Mirror)."""
    return mode in (None, "mirror")


def draft_share(cores: int, target_core_ms: float | None, draft_core_ms: float | None) -> int:
    """How many of `cores` Mirror's CPU draft gets: the fewest whose rollout ends when the target's overlapped part
    (on the other cores) does, the work of each split evenly over its cores: `draft_core_ms` / d <= `target_core_ms`
    / (cores - d), i.e. d = ceil(cores * draft / (draft + target)); at least 1, and 1 where a cost is unknown; at
    most cores - 1. The costs are core-milliseconds (ms measured times the threads it ran on) of one step: the
    draft's rollout, the target's part that runs beside it."""
    if cores < 2 or not target_core_ms or not draft_core_ms or target_core_ms <= 0 or draft_core_ms <= 0:
        return 1
    wanted = math.ceil(cores * draft_core_ms / (draft_core_ms + target_core_ms) - 1e-9)
    return max(1, min(cores - 1, wanted))


def plan(target: str, draft: str, mode: str | None, cores: list[int], threads: int | None = None,
         draft_cores: int | None = None) -> Placement:
    """The placement of a target on `target` and a draft on `draft` for `mode` (None: Mirror) on the usable `cores`;
    `threads`: a fixed thread count for both workers, unpinned (the bench's and tests' override); `draft_cores`: how
    many cores a CPU draft beside a CPU target gets in Mirror (`draft_share` of measured costs; None: 1)."""
    n, target, draft = len(cores), str(target), str(draft)
    if threads is not None:
        return Placement(target, draft, None, None, threads, threads)
    if is_accelerator(target):
        # the target thread launches kernels and waits: the CPU is the draft's (every core)
        return Placement(target, draft, None, None, None, None if is_accelerator(draft) else n)
    if runs_mirror(mode) and n >= 2 and not is_accelerator(draft):
        share = max(1, min(n - 1, draft_cores or 1))
        target_cpus, draft_cpus = tuple(cores[:n - share]), tuple(cores[n - share:])
        return Placement(target, draft, target_cpus, draft_cpus, len(target_cpus), len(draft_cpus))
    return Placement(target, draft, None, None, n, None if is_accelerator(draft) else n)


def _side(device: str, cpus: tuple[int, ...] | None, threads: int | None) -> str:
    count = "" if threads is None else f", {threads} thread{'s' * (threads != 1)}"
    if cpus:
        where = f" pinned to core{'s' * (len(cpus) > 1)} {_ranges(cpus)}"
    elif is_accelerator(device):
        where = " (thread not pinned)"
    else:
        where = " (not pinned)"
    return f"{device}{count}{where}"


def _ranges(cpus: tuple[int, ...]) -> str:
    """Cores as runs: (0, 1, 2, 3, 7) -> "0-3,7"."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" if b > a + 1 else f"{a},{b}" for a, b in runs)
