"""Where the two workers run: the cores and threads of the target and the draft, chosen by device and mode.

Mirror with both on the CPU (2+ cores): a core and a thread each (they must not contend). A target on an
accelerator only launches work: not pinned, a CPU draft gets every core. `ar` / `sd`: every core for whoever runs.
Pure: it reads no device, it is told them.
"""

from __future__ import annotations

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
    def worker_cores(self) -> tuple[int, int] | None:
        """(target core, draft core) when each worker is pinned to one core (the engine's `cpus`), else None."""
        if self.target_cpus and self.draft_cpus and len(self.target_cpus) == len(self.draft_cpus) == 1:
            return self.target_cpus[0], self.draft_cpus[0]
        return None

    def describe(self) -> str:
        """`target torch:cuda:0 (thread not pinned); draft ort:cpu, 16 threads on any of 16 cores`."""
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


def plan(target: str, draft: str, mode: str | None, cores: list[int], threads: int | None = None) -> Placement:
    """The placement of a target on `target` and a draft on `draft` for `mode` (None: Mirror) on the usable `cores`;
    `threads`: a fixed thread count for both workers, unpinned (the bench's and tests' override)."""
    n, target, draft = len(cores), str(target), str(draft)
    if threads is not None:
        return Placement(target, draft, None, None, threads, threads)
    if is_accelerator(target):
        # the target thread launches kernels and waits: the CPU is the draft's (every core)
        return Placement(target, draft, None, None, None, None if is_accelerator(draft) else n)
    if runs_mirror(mode) and n >= 2 and not is_accelerator(draft):
        return Placement(target, draft, (cores[0],), (cores[1],), 1, 1)
    return Placement(target, draft, None, None, n, None if is_accelerator(draft) else n)


def _side(device: str, cpus: tuple[int, ...] | None, threads: int | None) -> str:
    count = "" if threads is None else f", {threads} thread{'s' * (threads != 1)}"
    if cpus:
        where = f" pinned to core{'s' * (len(cpus) > 1)} {','.join(map(str, cpus))}"
    elif is_accelerator(device):
        where = " (thread not pinned)"
    else:
        where = " (not pinned)"
    return f"{device}{count}{where}"
