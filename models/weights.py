"""A checkpoint's weights where they lie: a GGUF file (models.gguf_file) or a Hugging Face folder's safetensors.

`open_weights(path)` gives one view of either: `config`, `tensors` (checkpoint name -> models.tensor_files.TensorInfo:
type, rows, columns, file, offset), `array(name)` (one tensor as float32, q and k in the Hugging Face row order) and
`permuted` (q and k rows stored for rotary embedding over adjacent pairs: llama GGUFs). Checkpoint names: embed, norm,
head (absent when tied to the embedding), rope_freqs (llama3 GGUFs), and per layer `layers.{i}.` attn_norm, q, k, v,
q_bias, k_bias, v_bias, o, q_norm, k_norm, ffn_norm, gate, up, down. Nothing is read whole: exports and loaders take
one tensor at a time, so memory stays near one tensor's size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mirror_rt.models.tensor_files import SAFETENSORS_TYPES, TensorInfo, float_array, safetensors_table

HF_LAYER_NAMES = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
                  "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v", "self_attn.q_proj.bias": "q_bias",
                  "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
                  "self_attn.o_proj.weight": "o", "self_attn.q_norm.weight": "q_norm",
                  "self_attn.k_norm.weight": "k_norm", "post_attention_layernorm.weight": "ffn_norm",
                  "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down"}
HF_TOP_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "head"}


class FolderWeights:
    """A Hugging Face folder: config.json and safetensors files (sharded or not), read tensor by tensor."""

    permuted = False  # Hugging Face's own rotary row order

    def __init__(self, folder: Path):
        from mirror_rt.models.loading import ModelError, read_config

        self.path = Path(folder)
        self.config = read_config(self.path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelError(f"no .safetensors weights in {self.path}")
        self.tensors = {}
        for file in files:
            try:
                table = safetensors_table(file)
            except ValueError as exc:
                raise ModelError(str(exc)) from None
            for key, entry in table.items():
                name = _checkpoint_name(key)
                if name is not None:
                    self.tensors[name] = _info(name, entry, file)
        if self.config.tie_embeddings:
            self.tensors.pop("head", None)
        _check_shapes(self.config, self.tensors, self.path)

    def array(self, name: str) -> np.ndarray:
        return float_array(self.tensors[name])


def open_weights(path) -> FolderWeights:
    """The weights of a Hugging Face folder or a .gguf file (ModelError / GGUFError naming the path when they cannot
    be read)."""
    path = Path(path)
    if path.suffix == ".gguf" and path.is_file():
        from mirror_rt.models.gguf_file import GGUFModel

        return GGUFModel(path)
    return FolderWeights(path)


def expected_shapes(config) -> dict[str, tuple[int, int]]:
    """(rows, columns) of every weight a model of `config` needs (vectors: rows 1)."""
    c = config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {"embed": (c.vocab_size, c.hidden_size), "norm": (1, c.hidden_size)}
    if not c.tie_embeddings:
        shapes["head"] = (c.vocab_size, c.hidden_size)
    layer = {"attn_norm": (1, c.hidden_size), "q": (q, c.hidden_size), "k": (kv, c.hidden_size),
             "v": (kv, c.hidden_size), "o": (c.hidden_size, q), "ffn_norm": (1, c.hidden_size),
             "gate": (c.intermediate_size, c.hidden_size), "up": (c.intermediate_size, c.hidden_size),
             "down": (c.hidden_size, c.intermediate_size)}
    if c.attention_bias:
        layer |= {"q_bias": (1, q), "k_bias": (1, kv), "v_bias": (1, kv)}
    if c.qk_norm:
        layer |= {"q_norm": (1, c.head_dim), "k_norm": (1, c.head_dim)}
    for i in range(c.n_layers):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _check_shapes(config, tensors: dict, where: Path) -> None:
    from mirror_rt.models.loading import ModelError

    expected = expected_shapes(config)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ModelError(f"{where}: weights do not match the config (missing {missing[:3]})")
    wrong = [f"{n} is {[t.rows, t.columns]} in the weights, {list(expected[n])} by the config"
             for n, t in tensors.items() if n in expected and (t.rows, t.columns) != expected[n]]
    if wrong:
        raise ModelError(f"{where}: weights do not match the config: {wrong[0]}"
                         + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))


def _checkpoint_name(key: str) -> str | None:
    if key in HF_TOP_NAMES:
        return HF_TOP_NAMES[key]
    parts = key.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in HF_LAYER_NAMES:
        return f"layers.{parts[2]}.{HF_LAYER_NAMES[parts[3]]}"
    return None


def _info(name: str, entry: dict, file: Path) -> TensorInfo:
    from mirror_rt.models.loading import ModelError

    if entry["dtype"] not in SAFETENSORS_TYPES:
        raise ModelError(f"{file}: {name} is {entry['dtype']} (mirror-rt reads F32, F16 and BF16 safetensors)")
    shape = entry["shape"]
    rows, columns = (shape[0], int(np.prod(shape[1:]))) if len(shape) > 1 else (1, shape[0] if shape else 1)
    return TensorInfo(name, SAFETENSORS_TYPES[entry["dtype"]], rows, columns, file, entry["offset"], entry["nbytes"])
