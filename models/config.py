"""Model shape configuration: the one description of a decoder's geometry.

`ModelConfig` is built from a Hugging Face `config.json` (Llama family only) or from a
named preset (`tiny`, `tiny-draft`, used by tests and the CLI smoke test; `smollm2-135m`,
`smollm2-1.7b`: real geometry for random-weight device checks). It knows
nothing about weights, devices or caches. Invariant: a config that validates can be
instantiated by `models.transformer.Transformer` without further checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mirror_rt.runtime.values import is_integer

# HF `model_type` values this runtime implements, with the per-family switches.
SUPPORTED_ARCHITECTURES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
}


class UnsupportedArchitecture(ValueError):
    """Raised for a model family this runtime does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of a Llama-family decoder-only transformer."""

    vocab_size: int  # rows of the embedding and of the LM head
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the SwiGLU MLP
    n_layers: int  # decoder blocks
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention when < n_heads)
    head_dim: int = 0  # 0 means hidden_size // n_heads
    max_seq_len: int = 2048  # positions the model was trained for (the context limit)
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: dict | None = None  # None, {"rope_type": "linear"|"llama3", ...}
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # LM head shares the embedding matrix
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    architecture: str = "llama"  # HF model_type, for messages and export
    bos_token_id: int | None = None  # from config.json, informative only
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)  # end-of-sequence ids

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        self.validate()

    def validate(self) -> None:
        """Check the shape is consistent; raise ValueError naming the bad field."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads",
                     "n_kv_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model config: n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim={self.head_dim} must be even for RoPE")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(_unsupported_message(self.architecture))
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ("default", "linear", "llama3"):
            raise UnsupportedArchitecture(f"unsupported rope_scaling type '{kind}' "
                                          "(supported: none, linear, llama3)")

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a parsed Hugging Face `config.json`."""
        arch = hf.get("model_type", "?")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(_unsupported_message(arch))
        family = SUPPORTED_ARCHITECTURES[arch]
        _refuse_unimplemented(hf, arch)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        scaling = hf.get("rope_scaling")
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or 0,
            max_seq_len=_context(hf),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", family.get("attention_bias", False))),
            qk_norm=family.get("qk_norm", False),
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_dict(self) -> dict:
        """Plain dict, JSON-serialisable (manifests, checkpoints)."""
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Inverse of `to_dict`."""
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """A named preset (see `PRESETS`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset '{name}' (known: {', '.join(PRESETS)})")
        return cls(**PRESETS[name])


def _refuse_unimplemented(hf: dict, arch: str) -> None:
    """UnsupportedArchitecture for a config field that changes what the model computes and that the runtime does
    not implement (it would run another model, silently)."""
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise UnsupportedArchitecture(f"unsupported hidden_act '{act}' (mirror-rt runs SiLU-gated MLPs)")
    if arch in ("llama", "mistral") and hf.get("attention_bias"):
        raise UnsupportedArchitecture(f"unsupported attention_bias on a {arch} model: its o_proj has a bias too, "
                                      "which mirror-rt does not implement (q/k/v biases alone: Qwen2)")
    if hf.get("mlp_bias"):
        raise UnsupportedArchitecture("unsupported mlp_bias (mirror-rt's MLPs have no biases)")


def _context(hf: dict) -> int:
    """The context limit: max_position_embeddings, or the sliding window where the model attends through one
    (Mistral's sliding_window; Qwen's only with use_sliding_window). Within the window every key is in it, so
    full attention computes the same; beyond it the runtime would attend to keys the model does not see."""
    context = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    return min(context, window) if isinstance(window, int) and window > 0 else context


DEFAULT_KAPPA = 8  # early-exit candidates per position: enough to cover most corrections, cheap to send


@dataclass(frozen=True)
class SplitConfig:
    """Where a target splits for Mirror's early exit, and how many candidates the exit sends per position.

    None means "not given": the default for the model, written once in `resolve` (after N // 2 layers;
    DEFAULT_KAPPA candidates). Torch targets, exported bundles and exit training all resolve it here, so one default
    and one validation hold for every path.
    """

    exit_layer: int | None = None  # ℓe: layers in the target's prefix; None: N // 2
    kappa: int | None = None  # early-exit candidates per position; None: DEFAULT_KAPPA

    def __post_init__(self):
        for flag, value in (("--exit-layer", self.exit_layer), ("--kappa", self.kappa)):
            if value is not None and not is_integer(value):
                raise ValueError(f"{flag} must be a whole number, got {value!r}")

    def resolve(self, config: ModelConfig) -> tuple[int, int]:
        """(exit layer, kappa) for a model of `config`; ValueError naming the flag when either cannot be."""
        n = config.n_layers
        exit_layer = n // 2 if self.exit_layer is None else self.exit_layer
        kappa = DEFAULT_KAPPA if self.kappa is None else self.kappa
        if not 1 <= exit_layer < n:
            raise ValueError(f"--exit-layer must be in 1..{n - 1} for a {n}-layer model, got {exit_layer}")
        if not 1 <= kappa <= config.vocab_size:
            raise ValueError(f"--kappa must be in 1..{config.vocab_size} (the vocabulary), got {kappa}")
        return exit_layer, kappa


def _unsupported_message(arch: str) -> str:
    known = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    return f"unsupported architecture '{arch}': mirror-rt runs Llama-family models ({known})"


# Tiny seeded models for tests and smoke runs; the draft shares the target's vocabulary.
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=258, hidden_size=64, intermediate_size=128, n_layers=4, n_heads=4,
                 n_kv_heads=2, max_seq_len=256, rope_theta=10000.0, eos_token_ids=(1,)),
    "tiny-draft": dict(vocab_size=258, hidden_size=32, intermediate_size=64, n_layers=2, n_heads=2,
                       n_kv_heads=1, max_seq_len=256, rope_theta=10000.0, eos_token_ids=(1,)),
    # The real geometry of SmolLM2-135M and -1.7B with random weights: `mirror-rt devices --check` times and
    # checks a machine with them offline (no download), at the shapes that matter for speed and memory.
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30, n_heads=9,
                         n_kv_heads=3, head_dim=64, max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True,
                         eos_token_ids=(2,)),
    "smollm2-1.7b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, n_layers=24, n_heads=32,
                         n_kv_heads=32, head_dim=64, max_seq_len=8192, rope_theta=130000.0, tie_embeddings=True,
                         eos_token_ids=(2,)),
}
