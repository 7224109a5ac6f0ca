"""A GGUF file read in place: its model config, and each weight where it lies in the file.

Nothing is converted as a whole: `GGUFModel.tensor(name)` describes a weight (GGUF type, rows, row length, the file
offset of its blocks), `array(name)` dequantizes that one tensor to float32 (norms, biases, the torch path one tensor
at a time). Weights are named as `models.checkpoint` names them for every source (embed, norm, head, and per layer
attn_norm, q, k, v, q_bias, ..., down). Families: llama (Llama 1-3, Mistral), qwen2, qwen3. A llama GGUF stores its
q and k rows permuted for rotary embedding over adjacent pairs (llama.cpp's layout): `permuted` says so; graphs
rotate such rows over pairs, and `array` restores the Hugging Face order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mirror_rt.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedArchitecture
from mirror_rt.models.gguf_header import GGUFError, check_gguf
from mirror_rt.models.memory import out_of_memory_error
from mirror_rt.models.tensor_files import TensorInfo
from mirror_rt.runtime.values import error_line

LAYER_NAMES = {"attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v",
               "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias", "attn_output.weight": "o",
               "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm", "ffn_norm.weight": "ffn_norm",
               "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down"}
TOP_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "head",
             "rope_freqs.weight": "rope_freqs"}


class GGUFModel:
    """A GGUF model file: `config`, `tensors` by checkpoint name, `array(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        reader = _reader(self.path)
        self.metadata = {key: _value(field) for key, field in reader.fields.items()
                         if not key.startswith("tokenizer.ggml.")}
        arch = str(self.metadata.get("general.architecture", "?"))
        self.tensors = _tensor_table(reader, self.path)
        self.config = _config(self.metadata, arch, self.tensors, self.path)
        self.permuted = arch == "llama"  # q/k rows in llama.cpp's pairwise rotary order
        self._map = None

    def tensor(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def array(self, name: str, hf_order: bool = True) -> np.ndarray:
        """One tensor dequantized to float32, [rows, columns] (vectors: [columns]); q and k of a llama GGUF in the
        Hugging Face row order unless `hf_order` is False (then as the file holds them)."""
        from gguf.quants import dequantize

        info = self.tensors[name]
        raw = self._bytes(info)
        values = dequantize(raw.reshape(info.rows, -1), info.type).astype(np.float32, copy=False)
        values = values.reshape(info.rows, info.columns) if info.rows > 1 else values.reshape(info.columns)
        if hf_order and self.permuted and name.rsplit(".", 1)[-1] in ("q", "k"):
            heads = self.config.n_heads if name.endswith(".q") else self.config.n_kv_heads
            values = unpermute_rows(values, heads)
        return values

    def _bytes(self, info: TensorInfo) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map[info.offset:info.offset + info.nbytes]


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's pairwise rotary row order of q or k ([heads * head_dim, ...]) back to Hugging Face's halves."""
    head_dim = w.shape[0] // heads
    return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _reader(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    check_gguf(path)  # in under a second; gguf-py's reader takes 40-50 s over a 7B's tokenizer
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 -- gguf raises many kinds for a file it cannot parse
        if out_of_memory_error(exc):  # the machine's limit, not the file's fault
            raise
        raise GGUFError(f"cannot read {path} (cut short, or not a GGUF model?): {error_line(exc)}") from None


def _value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 -- a field of a type gguf cannot decode: not one mirror-rt reads
        return None


def _tensor_table(reader, path: Path) -> dict[str, TensorInfo]:
    size = path.stat().st_size
    table = {}
    for t in reader.tensors:
        name = _checkpoint_name(t.name)
        if name is None:
            continue
        shape = [int(d) for d in t.shape]  # GGUF order: [columns, rows]
        info = TensorInfo(name, int(t.tensor_type), shape[1] if len(shape) > 1 else 1, shape[0], path,
                          int(t.data_offset), int(t.n_bytes))
        if info.offset + info.nbytes > size:
            raise GGUFError(f"{path} is cut short: {t.name} ends at byte {info.offset + info.nbytes}, "
                            f"the file has {size}")
        table[name] = info
    return table


def _checkpoint_name(gguf_name: str) -> str | None:
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    return None


def _config(meta: dict, arch: str, tensors: dict, path: Path) -> ModelConfig:
    """The model's ModelConfig from the GGUF metadata, as a Hugging Face config.json would give it."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported architecture '{arch}': mirror-rt runs Llama-family models "
                        f"({', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    if "embed" not in tensors:
        raise GGUFError(f"{path} lacks weights the model needs: token_embd.weight")
    heads = int(key("attention.head_count", 0) or 0)
    hf = {"model_type": arch, "vocab_size": tensors["embed"].rows, "hidden_size": key("embedding_length"),
          "intermediate_size": key("feed_forward_length"), "num_hidden_layers": key("block_count"),
          "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
          "head_dim": key("attention.key_length"), "max_position_embeddings": key("context_length", 2048),
          "rope_theta": key("rope.freq_base", 10000.0), "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
          "tie_word_embeddings": "head" not in tensors, "attention_bias": "layers.0.q_bias" in tensors}
    if arch == "llama":
        hf["attention_bias"] = False  # (llama GGUFs with q/k/v biases are refused below: not a family we run)
    scaling = key("rope.scaling.type")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
    elif scaling not in (None, "none"):
        raise GGUFError(f"{path}: unsupported rope scaling '{scaling}' (supported: none, linear, llama3)")
    try:
        config = ModelConfig.from_hf(hf)
    except (UnsupportedArchitecture, ValueError, TypeError, KeyError) as exc:
        raise GGUFError(f"{path}: {error_line(exc)}") from None
    _check_weights(config, tensors, path)
    return config


def _check_weights(config: ModelConfig, tensors: dict, path: Path) -> None:
    per_layer = ["attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down"]
    per_layer += ["q_bias", "k_bias", "v_bias"] if config.attention_bias else []
    per_layer += ["q_norm", "k_norm"] if config.qk_norm else []
    missing = [n for n in ["embed", "norm"] if n not in tensors]
    names = [f"layers.{i}.{n}" for i in range(config.n_layers) for n in per_layer]
    missing += [name for name in names if name not in tensors]
    if missing:
        raise GGUFError(f"{path} lacks weights the model needs: {', '.join(missing[:3])}"
                        + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""))
    if config.architecture == "llama" and "layers.0.q_bias" in tensors:
        raise GGUFError(f"{path}: q/k/v biases on a llama model (its o_proj would need one too): not a family "
                        "mirror-rt runs")
