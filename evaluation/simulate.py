"""`mirror-rt simulate`: AR / SD / Mirror step times and speedups predicted by the latency model
(runtime.mirror.stats) from costs per device and rates (acceptance, root coverage), k = gamma:
    AR T_target(1);  SD k * T_draft + T_target(k+1);
    Mirror T_prefix(k+1) + T_rendezvous + max(T_suffix(k+1), T_rollout) + P(miss) * T_fresh
With n_s Speculative-Streaming streams a k-token rollout takes ceil(k / (1 + n_s)) forwards.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from mirror_rt.runtime.config import MAX_GAMMA
from mirror_rt.runtime.mirror.stats import hit_probability, mirror_step, sd_step, tokens_per_step
from mirror_rt.runtime.values import is_integer

COSTS = ("target_layer_ms", "target_head_ms", "draft_forward_ms", "rendezvous_ms")  # milliseconds, >= 0
MAX_MS = 1e6  # a cost beyond 1000 s is a typo, and 1e308 ms overflowed to inf tokens/s and NaN speedups
MAX_LAYERS = 10_000


@dataclass(frozen=True)
class SimConfig:
    """Costs and rates of one hardware/model setting."""

    name: str
    target_layers: int  # N
    exit_layer: int  # l_e
    target_layer_ms: float  # one target layer over a 1-token window
    window_growth: float  # extra cost per extra window token, as a fraction of the 1-token cost
    target_head_ms: float  # final norm + LM head (1 token)
    draft_forward_ms: float  # one draft forward (a batched branch forward costs the same)
    gamma: int  # k
    acceptance: float  # per-token acceptance a
    root_coverage: float  # P(correction is among the precomputed roots | mismatch)
    rendezvous_ms: float = 0.0  # message latency between devices per step
    ss_streams: int = 0  # Speculative-Streaming lookahead streams of the draft
    branches_batched: bool = True  # side branches ride in the main line's draft forwards

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {json.dumps(self.name)}")
        for name in ("target_layers", "exit_layer", "gamma", "ss_streams"):
            value = getattr(self, name)
            if not is_integer(value):
                raise ValueError(f"{name} must be an integer, got {json.dumps(value)}")
        for name in COSTS + ("window_growth", "acceptance", "root_coverage"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {json.dumps(value)}")
            if name in COSTS + ("window_growth",) and value > MAX_MS:
                raise ValueError(f"{name} must be at most {MAX_MS:g}, got {json.dumps(value)}")
        for name, low, high in (("target_layers", 2, MAX_LAYERS), ("exit_layer", 1, self.target_layers - 1),
                                ("gamma", 1, MAX_GAMMA), ("ss_streams", 0, MAX_GAMMA)):
            if not low <= getattr(self, name) <= high:
                why = " (an exit layer lies between)" if name == "target_layers" else ""
                raise ValueError(f"{name} must be in {low}..{high}{why}, got {getattr(self, name)}")
        if not isinstance(self.branches_batched, bool):
            raise ValueError(f"branches_batched must be true or false, got {json.dumps(self.branches_batched)}")
        if not 0 <= self.acceptance < 1:
            raise ValueError(f"acceptance must be in [0, 1), got {self.acceptance}")
        if not 0 <= self.root_coverage <= 1:
            raise ValueError(f"root_coverage must be in [0, 1], got {self.root_coverage}")
        if self.target_layer_ms + self.target_head_ms <= 0:
            raise ValueError("target_layer_ms and target_head_ms cannot both be 0 (a target forward costs time)")


def target_ms(cfg: SimConfig, layers: int, window: int, head: bool) -> float:
    growth = 1 + cfg.window_growth * (window - 1)
    return layers * cfg.target_layer_ms * growth + (cfg.target_head_ms * growth if head else 0.0)


def draft_ms(cfg: SimConfig, tokens: int) -> float:
    return math.ceil(tokens / (1 + cfg.ss_streams)) * cfg.draft_forward_ms


def predict(cfg: SimConfig) -> dict:
    """AR / SD / Mirror time per step, tokens per step, tokens/s and speedups over AR."""
    a, k = cfg.acceptance, cfg.gamma
    tokens = tokens_per_step(a, k)
    ar = target_ms(cfg, cfg.target_layers, 1, True)
    sd = sd_step(draft_ms(cfg, k), target_ms(cfg, cfg.target_layers, k + 1, True))
    prefix = target_ms(cfg, cfg.exit_layer, k + 1, True)  # the early exit applies the head too
    suffix = target_ms(cfg, cfg.target_layers - cfg.exit_layer, k + 1, True)
    rollout = draft_ms(cfg, k + 1) * (1 if cfg.branches_batched else 2)
    p_hit = hit_probability(a, k, cfg.root_coverage)
    mirror = mirror_step(prefix, suffix, rollout, draft_ms(cfg, k), p_hit, cfg.rendezvous_ms)
    return {
        "name": cfg.name, "tokens_per_step": round(tokens, 3), "p_hit": round(p_hit, 3),
        "ar_ms_per_token": round(ar, 3), "sd_ms_per_step": round(sd, 3), "mirror_ms_per_step": round(mirror, 3),
        "ar_tokens_per_s": round(1000 / ar, 2), "sd_tokens_per_s": round(1000 * tokens / sd, 2),
        "mirror_tokens_per_s": round(1000 * tokens / mirror, 2),
        "sd_speedup": round(ar * tokens / sd, 3), "mirror_speedup": round(ar * tokens / mirror, 3),
    }


# the paper's setting (Qwen3-14B on M2 Ultra GPUs, a 0.6B SS draft on the NPU) with assumed, not measured, costs
PRESETS = {
    "qwen3-14b-m2ultra": dict(name="qwen3-14b-m2ultra (assumed costs)", target_layers=40, exit_layer=20,
                              target_layer_ms=0.9, window_growth=0.015, target_head_ms=1.5,
                              draft_forward_ms=4.0, gamma=7, acceptance=0.8, root_coverage=0.6,
                              rendezvous_ms=0.2, ss_streams=2),
}


def load_config(ref: str) -> SimConfig:
    """A preset name or a JSON file with SimConfig's fields."""
    if ref in PRESETS:
        return SimConfig(**PRESETS[ref])
    path = Path(ref)
    if not path.is_file():
        raise ValueError(f"simulate: no preset or file named '{ref}' (presets: {', '.join(PRESETS)})")
    try:
        fields = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"simulate: {path}: not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"simulate: {path}: a JSON object of SimConfig's fields is needed, "
                         f"got {type(fields).__name__}")
    known = {f.name: f for f in dataclasses.fields(SimConfig)}
    unknown = sorted(set(fields) - set(known))
    missing = [n for n, f in known.items() if n not in fields and f.default is dataclasses.MISSING]
    if unknown or missing:
        said = [f"unknown {', '.join(unknown)}" if unknown else "", f"missing {', '.join(missing)}" if missing else ""]
        raise ValueError(f"simulate: {path}: fields {'; '.join(s for s in said if s)}")
    try:
        return SimConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"simulate: {path}: {exc}") from None


def format_prediction(cfg: SimConfig, result: dict) -> str:
    """`predict`'s result as the lines `mirror-rt simulate` prints: the setting, then each method's step time."""
    lines = [f"{result['name']}: gamma {cfg.gamma}, acceptance {cfg.acceptance}, tokens per step "
             f"{result['tokens_per_step']}, P(reuse hit) {result['p_hit']}"]
    for method in ("ar", "sd", "mirror"):
        step = result["ar_ms_per_token"] if method == "ar" else result[f"{method}_ms_per_step"]
        speedup = 1.0 if method == "ar" else result[f"{method}_speedup"]
        lines.append(f"  {method:6s} {step:8.2f} ms per step  {result[f'{method}_tokens_per_s']:8.1f} tokens/s  "
                     f"{speedup:.2f}x")
    return "\n".join(lines)
