"""`mirror-rt devices --check`: every device pair here (the target on the CPU and on each CUDA device, an int8 draft
on the CPU), checked and timed offline on presets with real geometry and random weights. Per pair: greedy equality
of sd and mirror against ar (with the target's top-2 margin at a first mismatch), CUDA's fp32 ar against the CPU's,
tokens/s, device->host bytes per token and reads per step, kernel launches per forward and peak memory (CUDA).
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mirror_rt.devices.options import EngineConfig
from mirror_rt.devices.torch_engine import load_torch
from mirror_rt.runtime.affinity import available_cores
from mirror_rt.runtime.transfer import host_floats

PROMPT = "The history of the transistor begins with"
MODES = ("ar", "sd", "mirror")

CHECK_TOKENS = 48  # tokens per run of the check: enough to time a pair, short enough to check many
MAX_CHECK_TOKENS = 1024  # the check's prompt and output stay well inside every preset's context
CHECK_OUT = "devices-check.json"


@dataclass
class PairCheck:
    """What one (model, target device, precision) pair did."""

    model: str  # preset name
    target: str  # torch device of the target
    draft: str  # the draft and its device
    precision: str  # "target / draft": the target's weights, compute and KV share one dtype
    compiled: bool  # --compile (static windows under torch.compile)
    placement: str  # cores and threads of each worker
    tokens_per_s: dict[str, float] = field(default_factory=dict)  # per mode
    equal: dict[str, bool] = field(default_factory=dict)  # sd / mirror tokens == ar tokens
    margin: dict[str, float | None] = field(default_factory=dict)  # target top-2 margin at a first mismatch
    device_to_host_bytes_per_token: dict[str, float] = field(default_factory=dict)  # per mode
    reads_per_step: dict[str, float] = field(default_factory=dict)  # per mode (each read of a GPU tensor syncs)
    launches_per_forward: int | None = None  # CUDA kernel and graph launches of one 1-token forward
    peak_memory_mb: float | None = None  # CUDA: peak allocated while the pair ran
    tokens: dict[str, list[int]] = field(default_factory=dict)  # ar tokens (for cross-device comparison)
    load_s: float | None = None  # the target's random weights made and the int8 draft copied, seconds


def top2_margin(model, prompt_ids: list[int], tokens: list[int], index: int) -> float:
    """The target's logit margin between its top two tokens after prompt + tokens[:index] (one eager forward)."""
    import torch

    with torch.inference_mode():
        cache = model.new_cache(len(prompt_ids) + index + 1)
        logits = model.forward(list(prompt_ids) + list(tokens[:index]), cache, last_rows=1)[-1]
        top = torch.topk(logits.float(), 2).values
    first, second = host_floats(top)
    return first - second


def first_mismatch(expected: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None when equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def check_pair(model: str, device: str, dtype: str | None, compile: bool, max_new_tokens: int,
               log=print) -> PairCheck:
    """Load the preset on `device` (int8 draft on the CPU), run ar / sd / mirror, measure."""
    import torch

    options = EngineConfig.from_flags(model=model, draft_model="int8", device=device, dtype=dtype, compile=compile)
    log(f"devices --check: {model} on {device}: loading (random weights{', compiling' if compile else ''}, an int8 "
        "draft copy on the CPU)")
    started = time.perf_counter()
    engine = load_torch(options, log=lambda *a: None)
    names = engine.names
    check = PairCheck(model, device, "torch:cpu int8 copy", f"{names['target_precision']} / "
                      f"{names['draft_precision']}", compile, names["placement"],
                      load_s=round(time.perf_counter() - started, 1))
    log(f"devices --check: {model} on {device} ({check.precision}): loaded in {check.load_s:.1f} s")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    options = dict(max_new_tokens=max_new_tokens, ignore_eos=True, chat=False)
    for mode in MODES:
        engine.generate(PROMPT, mode=mode, **(options | {"max_new_tokens": 8}))  # warm-up (compile, allocator)
        gen = engine.generate(PROMPT, mode=mode, **options)
        check.tokens[mode] = gen.tokens
        check.tokens_per_s[mode] = gen.stats["decode_tokens_per_s"]
        check.device_to_host_bytes_per_token[mode] = gen.stats["device_to_host_bytes_per_token"]
        check.reads_per_step[mode] = gen.stats["device_reads_per_step"]
        log(f"devices --check: {model} on {device} ({check.precision}), {mode}: "
            f"{check.tokens_per_s[mode]:.1f} tokens/s")
    prompt_ids = engine.prompt_ids(PROMPT, chat=False)
    for mode in ("sd", "mirror"):
        index = first_mismatch(check.tokens["ar"], check.tokens[mode])
        check.equal[mode] = index is None
        check.margin[mode] = None if index is None else top2_margin(engine.target, prompt_ids,
                                                                     check.tokens["ar"], index)
    if device.startswith("cuda"):
        check.launches_per_forward = launches_per_forward(engine.target, prompt_ids)
        check.peak_memory_mb = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return check


def launches_per_forward(target, prompt_ids: list[int]) -> int:
    """CUDA kernel and graph launches of one 1-token forward after the prompt (counted by torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cache = target.new_cache(len(prompt_ids) + 4)
    target.forward(prompt_ids, cache)
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # torch's note that a second profiler clears the first's events: not ours
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            target.forward(prompt_ids[-1:], cache)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "LaunchKernel" in e.name or "GraphLaunch" in e.name)


def run_check(models: list[str] | None = None, max_new_tokens: int = CHECK_TOKENS, compile: bool = False,
              log=print) -> dict:
    """Every pair found here; returns the JSON document (`cuda`: devices found, `pairs`, `cross_device`).

    `compile`: the CUDA pairs run compiled (CUDA graphs); without CUDA, the CPU pair (inductor).
    """
    import torch

    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    models = models or (["smollm2-135m", "smollm2-1.7b"] if cuda else ["smollm2-135m"])
    pairs, cross = [], []
    for model in models:  # `compile`: the GPU pairs where there are any (the CPU pair stays the eager yardstick)
        gpu = [check_pair(model, device, dtype, compile, max_new_tokens, log)  # bf16 (fp16) default, then fp32
               for device in cuda for dtype in (None, "float32")]  # first: the CPU pair of 1.7B takes minutes
        cpu = check_pair(model, "cpu", "float32", compile and not cuda, max_new_tokens, log)
        pairs += [cpu, *gpu]
        cross += [compare_devices(model, cpu, fp32) for fp32 in gpu[1::2]]
    return {"torch": torch.__version__, "cuda": cuda, "cores": len(available_cores()),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "pairs": [asdict(p) for p in pairs], "cross_device": cross}


def compare_devices(model: str, cpu: PairCheck, gpu: PairCheck) -> dict:
    """ar in fp32 on the GPU against ar in fp32 on the CPU; the CPU target's top-2 margin at a mismatch."""
    index = first_mismatch(cpu.tokens["ar"], gpu.tokens["ar"])
    margin = None
    if index is not None:
        options = EngineConfig.from_flags(model=model, draft_model="target", device="cpu", dtype="float32")
        engine = load_torch(options, log=lambda *a: None)
        margin = top2_margin(engine.target, engine.prompt_ids(PROMPT, chat=False), cpu.tokens["ar"], index)
    return {"model": model, "devices": f"{gpu.target} vs cpu", "precision": "fp32", "equal": index is None,
            "first_mismatch": index, "cpu_top2_margin": margin}


def format_check(doc: dict) -> str:
    """One screen: a header line, a row per pair, the cross-device comparisons."""
    import torch

    none = "no CUDA device found" + (" (a CPU build of torch)" if torch.version.cuda is None else "")
    head = f"torch {doc['torch']}, {doc['cores']} cores; " + (
        f"CUDA: {', '.join(doc['cuda'])}" if doc["cuda"] else f"{none}: checked the CPU only")
    lines = [head, f"{'model':13s} {'target':7s} {'precision':11s} {'comp':4s} {'ar':>6s} {'sd':>6s} {'mirror':>6s} "
                   f"{'sd=ar':>6s} {'mir=ar':>6s} {'d2h B/tok':>9s} {'reads/st':>8s} {'launch':>6s} {'peak MB':>8s}"]
    for p in doc["pairs"]:
        tps = [f"{p['tokens_per_s'][m]:6.1f}" for m in MODES]
        same = [_equal(p, m) for m in ("sd", "mirror")]
        lines.append(f"{p['model']:13s} {p['target']:7s} {p['precision']:11s} {'yes' if p['compiled'] else 'no':4s} "
                     f"{' '.join(tps)} {same[0]:>6s} {same[1]:>6s} "
                     f"{p['device_to_host_bytes_per_token']['mirror']:9.0f} {p['reads_per_step']['mirror']:8.2f} "
                     f"{_opt(p['launches_per_forward']):>6s} {_opt(p['peak_memory_mb']):>8s}")
    for c in doc["cross_device"]:
        verdict = "equal" if c["equal"] else f"differs at token {c['first_mismatch']} (CPU top-2 margin " \
                                             f"{c['cpu_top2_margin']:.4f})"
        lines.append(f"{c['model']}: ar {c['precision']} {c['devices']}: {verdict}")
    lines.append("precision: target weights/compute/KV / draft; tokens/s: decode, greedy, random weights")
    lines.append("d2h B/tok, reads/st: mirror's target, device->host bytes per token, reads (syncs) per step; "
                 "no 0.012: differs, top-2 margin")
    return "\n".join(lines)


def _equal(p: dict, mode: str) -> str:
    return "yes" if p["equal"][mode] else f"no {p['margin'][mode]:.3f}"


def _opt(x) -> str:
    return "n/a" if x is None else f"{x:g}"


def write_check(doc: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    return path
