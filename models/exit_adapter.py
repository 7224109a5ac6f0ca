"""A small trained early-exit adapter: a low-rank residual map on the hidden state at layer ℓe,
optionally after one attention read of the exit layer's own cached keys and values.

Invariant: an adapter refuses to load for a target whose config fingerprint differs.

Exit logits = the target's own (frozen, shared) head on the adapter's output; with `attention` it first
reads layer ℓe-1's cached keys and values (`mix`, the prefix graph) before the per-position map (`project`, the exit
graph). It changes which branches the draft precomputes, never the committed text.
Design notes: docs/design/models.md
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from mirror_rt.models.transformer import (
    RMSNorm,
    apply_rope,
    causal_mask,
    grouped_attention,
    rope_tables,
)

ADAPTER_KIND = "mirror-rt-exit-adapter"
ADAPTER_VERSION = 2  # 2: optional attention (version 1 files load as attention-free)


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
    attention: bool = False  # read layer ℓe-1's cached keys/values (then the head geometry below is set)
    n_heads: int = 0  # query heads of the attention read (the target's)
    n_kv_heads: int = 0  # key/value heads of the target's cache
    head_dim: int = 0

    def __post_init__(self):
        if self.rank < 1 or self.hidden_size < 1 or self.exit_layer < 1:
            raise AdapterError(f"exit adapter: rank, hidden_size and exit_layer must be >= 1, got {self}")
        if self.attention and min(self.n_heads, self.n_kv_heads, self.head_dim) < 1:
            raise AdapterError(f"exit adapter: attention needs n_heads, n_kv_heads and head_dim, got {self}")


def model_fingerprint(config) -> str:
    """sha256 of the target's ModelConfig (geometry, RoPE, vocabulary): the adapter's compatibility key."""
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class ExitAdapter(nn.Module):
    """h [T, hidden] -> h' [T, hidden]; `up` and `o_proj` start at zero and `scale` at one, so a new adapter
    leaves the exit as is."""

    def __init__(self, config: ExitAdapterConfig):
        super().__init__()
        self.config = config
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.down = nn.Linear(config.hidden_size, config.rank, bias=False)
        self.up = nn.Linear(config.rank, config.hidden_size, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        nn.init.normal_(self.down.weight, std=config.hidden_size ** -0.5)
        nn.init.zeros_(self.up.weight)
        if config.attention:
            self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.q_proj = nn.Linear(config.hidden_size, config.n_heads * config.head_dim, bias=False)
            self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.hidden_size, bias=False)
            nn.init.zeros_(self.o_proj.weight)

    @classmethod
    def for_model(cls, model, exit_layer: int, rank: int = 64, attention: bool = False) -> ExitAdapter:
        """An identity adapter for `model` at `exit_layer`, in the model's dtype.

        With `attention`, the query starts as layer ℓe-1's own (norm and q projection), which reads its keys.
        """
        c = model.config
        if not 1 <= rank <= c.hidden_size:
            raise AdapterError(f"--rank must be in 1..{c.hidden_size} (the hidden size), got {rank}")
        heads = {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim} if attention else {}
        config = ExitAdapterConfig(exit_layer=exit_layer, hidden_size=c.hidden_size, rank=rank, norm_eps=c.norm_eps,
                                   model_fingerprint=model_fingerprint(c), attention=attention, **heads)
        adapter = cls(config).to(model.embed_tokens.weight.dtype)
        if attention:
            last = model.layers[exit_layer - 1]
            with torch.no_grad():
                adapter.attn_norm.weight.copy_(last.input_layernorm.weight)
                adapter.q_proj.weight.copy_(last.self_attn.q_proj.weight)
        return adapter

    def mix(self, h: torch.Tensor, keys=None, values=None, rope=None, mask=None) -> torch.Tensor:
        """First stage of an attention adapter: h [T, hidden] -> x [T, hidden].

        keys/values [KVH, S, D] of layer ℓe-1 (RoPE applied, as cached), rope = (cos, sin) [T, D] at the
        window's positions, mask [T, S] bool (True: visible).
        """
        c = self.config
        x = self.scale * self.norm(h)
        q = self.q_proj(self.attn_norm(h)).reshape(-1, c.n_heads, c.head_dim).transpose(0, 1)  # [H, T, D]
        q = apply_rope(q, *rope)
        return x + self.o_proj(grouped_attention(q, keys, values, mask))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Second stage of an attention adapter, per position: x [T, hidden] -> h' [T, hidden]."""
        return x + self.up(self.down(x))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """An attention-free adapter: scale * n + up(down(n)), n = norm(h) (as version 1 files were trained)."""
        if self.config.attention:
            raise AdapterError("exit adapter: an attention adapter needs the exit layer's keys (use mix, then project)")
        n = self.norm(h)
        return self.scale * n + self.up(self.down(n))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def attends(adapter: ExitAdapter | None) -> bool:
    """True for an attention adapter (it needs layer ℓe-1's keys: `mix`, then `project`)."""
    return adapter is not None and adapter.config.attention


def exit_logits(model, h: torch.Tensor, adapter: ExitAdapter | None = None, mixed: bool = False) -> torch.Tensor:
    """Early-exit logits [T, vocab] of hidden h [T, hidden]: the target's norm + LM head, after the adapter if any.

    `mixed`: h is already the adapter's first stage (`mix`), so only `project` is left.
    """
    if adapter is None:
        return model.logits(h)
    return model.logits(adapter.project(h) if mixed else adapter(h))


def cached_exit_logits(model, h: torch.Tensor, adapter: ExitAdapter | None = None, keys=None, values=None,
                       start: int = 0) -> torch.Tensor:
    """Early-exit logits [T, vocab] of h [T, hidden] at positions start..start+T-1.

    An attention adapter also reads keys/values [KVH, >= start+T, D] of layer ℓe-1 (its cache, this
    window's rows written); others ignore them.
    """
    if not attends(adapter):
        return exit_logits(model, h, adapter)
    return exit_logits(model, cached_mix(model, adapter, h, keys, values, start), adapter, mixed=True)


def cached_mix(model, adapter: ExitAdapter, h: torch.Tensor, keys, values, start: int = 0) -> torch.Tensor:
    """An attention adapter's first stage for h [T, hidden] at positions start.. (keys/values as above)."""
    T = h.shape[0]
    rope = rope_tables(model.inv_freq, torch.arange(start, start + T, device=h.device), h.dtype)
    return adapter.mix(h, keys[:, :start + T], values[:, :start + T], rope, causal_mask(start, T, h.device))


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
    from mirror_rt.models.tensor_files import save_tensors

    weights, meta = adapter_paths(path)
    weights.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in adapter.state_dict().items()}
    save_tensors(state, weights)
    record = {"kind": ADAPTER_KIND, "version": ADAPTER_VERSION, **asdict(adapter.config)}
    meta.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return weights, meta


def load_exit_adapter(path, model=None, exit_layer: int | None = None) -> ExitAdapter:
    """Read an adapter; with `model`, check it fits (and cast it to the model's dtype and device)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights, meta = adapter_paths(path)
    missing = [p.name for p in (weights, meta) if not p.is_file()]
    if missing:  # an adapter is a pair of files: say which was given and what is not there
        raise AdapterError(f"{path}: not an exit adapter (mirror-rt train-exit --out writes NAME.safetensors and "
                           f"NAME.json; missing {' and '.join(missing)} in {weights.parent})")
    try:
        record = json.loads(meta.read_text())
        state = load_file(str(weights))
    except (OSError, json.JSONDecodeError, SafetensorError) as exc:
        raise AdapterError(f"{meta if not meta.is_file() else weights}: unreadable ({type(exc).__name__})") from None
    if (not isinstance(record, dict) or record.pop("kind", None) != ADAPTER_KIND
            or record.pop("version", None) not in (1, ADAPTER_VERSION)):
        raise AdapterError(f"{meta}: not a mirror-rt exit adapter (versions 1..{ADAPTER_VERSION})")
    try:
        adapter = ExitAdapter(ExitAdapterConfig(**record))
        adapter.load_state_dict(state)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{weights}: weights do not match the adapter's config ({type(exc).__name__})") from None
    adapter.eval().requires_grad_(False)
    if model is not None:
        check_compatible(adapter, model, adapter.config.exit_layer if exit_layer is None else exit_layer, str(meta))
        p = model.embed_tokens.weight
        adapter.to(device=p.device, dtype=p.dtype)
    return adapter
