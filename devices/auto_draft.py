"""`--draft auto`: time the draft on every device here that runs it, beside the target, and put it where the
latency model (runtime.mirror.stats) predicts the most tokens per second, or nowhere (kept on a tie).

With one candidate nothing is timed. Otherwise the target's step, verify window and its halves, and each draft's
one-token forward (as loaded beside the target) and top-1 agreement with the target on a built-in text are
measured (medians, ms). It times the models it is given; loading them is devices.bundle_engine's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from mirror_rt.devices.placement import draft_share, is_accelerator
from mirror_rt.runtime.mirror.stats import hit_probability, mirror_step, sd_step, tokens_per_step

AUTO = "auto"
CALIBRATION = ("The capital of France is Paris. It is known for the Eiffel Tower, its museums and its food. "
               "Water boils at 100 degrees Celsius at sea level.")  # teacher-forced text of the acceptance check
WARMUP, TIMED = 2, 5  # forwards per measurement: first calls allocate, the median of the rest counts


@dataclass(frozen=True)
class TargetCosts:
    """The target's measured forwards on its device (ms)."""

    device: str
    token_ms: float  # a one-token forward: target-only decoding's step
    window_ms: float  # a verify window of gamma + 1 tokens
    prefix_ms: float | None = None  # Mirror: the window up to the early exit (None: the target is not split)
    suffix_ms: float | None = None  # Mirror: the window from the early exit on
    cores: int | None = None  # CPU cores it was measured on, pinned beside a CPU draft (None: not so)


@dataclass(frozen=True)
class DraftCandidate:
    """A device the draft could run on, as measured there."""

    device: str
    forward_ms: float  # one draft forward (one token; side branches ride in it)
    acceptance: float  # per-token acceptance estimate, in [0, 1]
    concurrent: bool = True  # runs while the target computes (other cores or another device): Mirror possible
    cores: int | None = None  # CPU cores it was measured on, pinned beside a CPU target (None: not so)


@dataclass(frozen=True)
class Pairing:
    """One way to decode and its predicted speed."""

    mode: str  # ar | sd | mirror
    draft: str | None  # the draft's device; None for ar
    tokens_per_s: float
    draft_cores: int | None = None  # Mirror beside a CPU target: the CPU cores the draft's cost needs (draft_share)

    def describe(self) -> str:
        where = "no speculation" if self.draft is None else f"{self.mode}, draft on {self.draft}"
        share = f" ({self.draft_cores} draft core{'s' * (self.draft_cores > 1)})" if self.draft_cores else ""
        return f"{where}{share} {self.tokens_per_s:.1f} tokens/s"


def pairings(target: TargetCosts, candidates: list[DraftCandidate], gamma: int,
             root_coverage: float = 0.0, rendezvous_ms: float = 0.0) -> list[Pairing]:
    """Every pairing's predicted tokens/s, fastest first; `ar` (no speculation) always among them."""
    options = [Pairing("ar", None, 1e3 / target.token_ms)]
    for draft in candidates:
        tokens = tokens_per_step(draft.acceptance, gamma)
        sd = sd_step(gamma * draft.forward_ms, target.window_ms)
        options.append(Pairing("sd", draft.device, 1e3 * tokens / sd))
        if draft.concurrent and target.prefix_ms is not None and target.suffix_ms is not None:
            p_hit = hit_probability(draft.acceptance, gamma, root_coverage)
            rollout, fresh = (gamma + 1) * draft.forward_ms, gamma * draft.forward_ms
            step = mirror_step(target.prefix_ms, target.suffix_ms, rollout, fresh, p_hit, rendezvous_ms)
            options.append(Pairing("mirror", draft.device, 1e3 * tokens / step, _draft_cores(target, draft, rollout)))
    return sorted(options, key=lambda p: (-p.tokens_per_s, p.draft is not None))  # a tie keeps no speculation


def _draft_cores(target: TargetCosts, draft: DraftCandidate, rollout_ms: float) -> int | None:
    """The draft's cores in Mirror where both were measured pinned on CPU cores of their own: as many as its rollout
    needs to end with the target's prefix (devices.placement.draft_share, on core-milliseconds), else None."""
    if not (target.cores and draft.cores and target.prefix_ms):
        return None
    return draft_share(target.cores + draft.cores, target.prefix_ms * target.cores, rollout_ms * draft.cores)


def choose(target: TargetCosts, candidates: list[DraftCandidate], gamma: int) -> tuple[Pairing, list[Pairing]]:
    """(the best pairing, all pairings fastest first)."""
    ranked = pairings(target, candidates, gamma)
    return ranked[0], ranked


def report(best: Pairing, ranked: list[Pairing], target: TargetCosts) -> str:
    """The one line `--draft auto` prints: what it chose, and the alternatives it beat."""
    others = "; ".join(p.describe() for p in ranked if p is not best)
    return (f"draft auto: {best.describe()} predicted with the target on {target.device} (latency model on "
            f"measured forwards); beside it: {others}")


def table(ranked: list[Pairing]) -> list[str]:
    """Rows for `mirror-rt devices`: mode, draft device, predicted tokens/s, fastest first."""
    return [f"{p.mode:6s} {p.draft or '-':16s} {p.tokens_per_s:8.1f} tokens/s (predicted)" for p in ranked]


def candidates(graph_format: str, devices: dict | None = None) -> list[str]:
    """Devices that run a draft of `graph_format` here (devices.bundles.bundle_format), CPU backends first."""
    from mirror_rt.devices.registry import FORMAT_BACKENDS, SHORT, available_devices

    devices = available_devices() if devices is None else devices
    found = []
    for backend in FORMAT_BACKENDS[graph_format]:
        for device in devices.get(backend, []):
            if backend == "onnxruntime" and device not in ("cpu", "qnn", "openvino", "dml", "coreml"):
                continue  # CUDA is refused for these graphs, Azure is no device
            if backend == "torch" and device != "cpu":
                continue
            found.append(f"{SHORT[backend]}:{device}")
    return sorted(found, key=is_accelerator)


def _timed_call(model, tokens: list[int], context: list[int], verb: str = "forward") -> float:
    """Median ms of `model.<verb>(tokens, cache)` from a cache holding `context` (rolled back after each call)."""
    cache = model.new_cache(len(context) + len(tokens) + 8)
    model.forward(context, cache)
    times = []
    for _ in range(WARMUP + TIMED):
        start = time.perf_counter()
        getattr(model, verb)(tokens, cache)
        times.append((time.perf_counter() - start) * 1e3)
        cache.rollback(len(context))
    return statistics.median(times[WARMUP:])


def measure_target(target, device: str, gamma: int, context: list[int], cores: int | None = None) -> TargetCosts:
    """The target's one-token step, its gamma + 1 window, and (split targets) the window's prefix and suffix;
    `cores`: the CPU cores it runs on, pinned beside a CPU draft (TargetCosts.cores)."""
    token = _timed_call(target, context[-1:], context[:-1])
    window_tokens = (context * (gamma + 2))[:gamma + 1]
    window = _timed_call(target, window_tokens, context)
    if not target.capabilities.split:
        return TargetCosts(device, token, window, cores=cores)
    prefix = _timed_call(target, window_tokens, context, "forward_prefix_only")
    return TargetCosts(device, token, window, prefix, max(window - prefix, 0.0), cores)


def acceptance(target, draft, ids: list[int]) -> float:
    """Top-1 agreement of `draft` with `target`, teacher-forced over `ids` (one prompt forward each)."""
    picks = []
    for model in (target, draft):
        cache = model.new_cache(len(ids) + 1)
        picks.append(np.asarray(model.forward(ids, cache)).argmax(axis=-1))
    return float(np.mean(picks[0] == picks[1]))


def measure_draft(draft, device: str, target, ids: list[int], concurrent: bool = True,
                  cores: int | None = None) -> DraftCandidate:
    """One candidate: the draft's one-token forward (ms) and its agreement with the target on `ids`; `cores`: the
    CPU cores it runs on, pinned beside a CPU target (DraftCandidate.cores)."""
    forward = _timed_call(draft, ids[-1:], ids[:-1])
    return DraftCandidate(device, forward, acceptance(target, draft, ids), concurrent, cores)


def pick(target, target_device: str, drafts: dict, tokenizer, gamma: int, cpu_concurrent: bool = True,
         threads: tuple[int | None, int | None] = (None, None)):
    """Time `target` and each loaded draft (device -> model) and choose: (the best pairing, the one line saying so,
    the table rows for `mirror-rt devices`). A CPU draft runs at once with a CPU target only when each has its own
    cores (`cpu_concurrent`); `threads`: (the target's, a CPU draft's) cores as they were placed then, from which a
    Mirror pairing's draft share is sized (Pairing.draft_cores)."""
    ids = tokenizer.encode(CALIBRATION)
    pinned = cpu_concurrent and not is_accelerator(target_device)
    target_costs = measure_target(target, target_device, gamma, ids, threads[0] if pinned else None)
    drafts = [measure_draft(draft, device, target, ids,
                            concurrent=cpu_concurrent or is_accelerator(device) or is_accelerator(target_device),
                            cores=threads[1] if pinned and not is_accelerator(device) else None)
              for device, draft in drafts.items()]
    best, ranked = choose(target_costs, drafts, gamma)
    costs = "; ".join(f"{d.device} {d.forward_ms:.1f} ms a token, acceptance {d.acceptance:.2f}" for d in drafts)
    line = f"mirror-rt: {report(best, ranked, target_costs)} (target {target_costs.token_ms:.1f} ms a token; {costs})"
    return best, line, table(ranked)
