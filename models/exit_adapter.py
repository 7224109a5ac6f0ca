"""A small trained early-exit adapter: a low-rank residual map on the hidden state at layer ℓe.

The exit logits are `model.logits(adapter(h))`: the adapter rewrites the exit hidden state in
its RMS-normalized form, n = norm(h), h' = scale * n + up(down(n)) (the final norm that follows
ignores the overall scale, so working at unit scale keeps training well conditioned whatever the
residual stream's magnitude at ℓe), and the target's *own* final norm and LM head (frozen,
shared, never copied) map h' to logits. It only changes which tokens the early exit proposes,
so it decides which branches the draft precomputes, never the committed text.

Stored as two small files next to each other: `<name>.safetensors` (the weights) and
`<name>.json` (exit layer, rank, hidden size, the target's fingerprint, training notes).
Invariant: an adapter refuses to load for a target whose config fingerprint differs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from mirror_rt.models.transformer import RMSNorm

ADAPTER_KIND = "mirror-rt-exit-adapter"
ADAPTER_VERSION = 1


class AdapterError(ValueError):
    """An adapter file that cannot be used with this target (one-line message naming the file)."""


@dataclass(frozen=True)
class ExitAdapterConfig:
    """Shape and provenance of one adapter."""

    exit_layer: int  # ℓe: the adapter reads the hidden state after this many layers
    hidden_size: int  # width of the target's residual stream
    rank: int = 64  # inner width of the low-rank map
    norm_eps: float = 1e-5  # epsilon of the adapter's input RMSNorm
    model_fingerprint: str = ""  # model_fingerprint(target.config) it was trained for
    notes: dict = field(default_factory=dict)  # training record: data, steps, coverage (informative)

    def __post_init__(self):
        if self.rank < 1 or self.hidden_size < 1 or self.exit_layer < 1:
            raise AdapterError(f"exit adapter: rank, hidden_size and exit_layer must be >= 1, got {self}")


def model_fingerprint(config) -> str:
    """sha256 of the target's ModelConfig (geometry, RoPE, vocabulary): the adapter's compatibility key."""
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class ExitAdapter(nn.Module):
    """h [T, hidden] -> h' [T, hidden]; `up` starts at zero and `scale` at one, so a new adapter leaves the exit as is."""

    def __init__(self, config: ExitAdapterConfig):
        super().__init__()
        self.config = config
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.down = nn.Linear(config.hidden_size, config.rank, bias=False)
        self.up = nn.Linear(config.rank, config.hidden_size, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        nn.init.normal_(self.down.weight, std=config.hidden_size ** -0.5)
        nn.init.zeros_(self.up.weight)

    @classmethod
    def for_model(cls, model, exit_layer: int, rank: int = 64) -> ExitAdapter:
        """An identity adapter for `model` at `exit_layer`, in the model's dtype."""
        c = model.config
        config = ExitAdapterConfig(exit_layer=exit_layer, hidden_size=c.hidden_size, rank=rank, norm_eps=c.norm_eps,
                                   model_fingerprint=model_fingerprint(c))
        return cls(config).to(model.embed_tokens.weight.dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = self.norm(h)
        return self.scale * n + self.up(self.down(n))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def exit_logits(model, h: torch.Tensor, adapter: ExitAdapter | None = None) -> torch.Tensor:
    """Early-exit logits [T, vocab] of hidden h [T, hidden]: the target's norm + LM head, after the adapter if any."""
    return model.logits(h if adapter is None else adapter(h))


def check_compatible(adapter: ExitAdapter, model, exit_layer: int, where: str = "exit adapter") -> None:
    """Raise AdapterError unless `adapter` was made for `model` at `exit_layer`."""
    c = adapter.config
    if c.exit_layer != exit_layer:
        raise AdapterError(f"{where}: trained for exit layer {c.exit_layer}, but the exit layer is {exit_layer}")
    if c.hidden_size != model.config.hidden_size or c.model_fingerprint != model_fingerprint(model.config):
        raise AdapterError(f"{where}: trained for another model (fingerprint {c.model_fingerprint[:12]}, "
                           f"this target {model_fingerprint(model.config)[:12]})")


def adapter_paths(path) -> tuple[Path, Path]:
    """(weights .safetensors, config .json) for `path` given with or without a suffix."""
    path = Path(path)
    stem = path.with_suffix("") if path.suffix in (".safetensors", ".json") else path
    return stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")


def save_exit_adapter(adapter: ExitAdapter, path) -> tuple[Path, Path]:
    """Write the weights (float32) and the json config; returns both paths."""
    from safetensors.torch import save_file

    weights, meta = adapter_paths(path)
    weights.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in adapter.state_dict().items()}
    save_file(state, str(weights))
    record = {"kind": ADAPTER_KIND, "version": ADAPTER_VERSION, **asdict(adapter.config)}
    meta.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return weights, meta


def load_exit_adapter(path, model=None, exit_layer: int | None = None) -> ExitAdapter:
    """Read an adapter; with `model`, check it fits (and cast it to the model's dtype and device)."""
    from safetensors.torch import load_file

    weights, meta = adapter_paths(path)
    try:
        record = json.loads(meta.read_text())
        state = load_file(str(weights))
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{meta if not meta.is_file() else weights}: unreadable ({type(exc).__name__})") from None
    if record.pop("kind", None) != ADAPTER_KIND or record.pop("version", None) != ADAPTER_VERSION:
        raise AdapterError(f"{meta}: not a mirror-rt exit adapter (version {ADAPTER_VERSION})")
    adapter = ExitAdapter(ExitAdapterConfig(**record))
    adapter.load_state_dict(state)
    adapter.eval().requires_grad_(False)
    if model is not None:
        check_compatible(adapter, model, adapter.config.exit_layer if exit_layer is None else exit_layer, str(meta))
        p = model.embed_tokens.weight
        adapter.to(device=p.device, dtype=p.dtype)
    return adapter
