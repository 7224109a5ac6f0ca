"""Small GGUF files written in tests: random weights in the block types users bring, a real vocabulary.

`write_gguf(path, arch=..., types=...)` writes a two-layer model of the llama, qwen2 (q/k/v biases) or qwen3 (q/k
norms) family whose products are stored in the GGUF types asked for (Q4_K, Q6_K, Q8_0, Q4_0, F16, ...), with the
default model's tokenizer (SmolLM2's vocabulary, merges and chat template, copied from its GGUF: the tests that
use it need the default model, as the `slow` tests do). K-type blocks are random bytes with small scales (valid
blocks, as sized_models.py writes them); the other types are quantized from random values by gguf-py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2


def default_gguf(cache_dir: str) -> Path:
    """The default model's GGUF (fetched once into the cache)."""
    from mirror_rt.models.default_model import GGUF_NAME, default_model_folder

    default_model_folder(cache_dir, log=lambda *a: None)
    return Path(cache_dir) / "downloads" / GGUF_NAME


def write_gguf(path: Path, vocab_gguf: Path, arch: str = "qwen2", types: dict | None = None, seed: int = 0,
               vocab_rows: int | None = None, layers: int = LAYERS, hidden: int = HIDDEN) -> Path:
    """A small model of `arch` at `path`; `types` maps weight kinds (embed, head, attn, ffn, down) to GGUF types."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader, GGUFWriter

    types = {"embed": T.Q8_0, "head": T.Q6_K, "attn": T.Q4_K, "ffn": T.Q4_K, "down": T.Q6_K} | (types or {})
    source = GGUFReader(str(vocab_gguf))
    tokens = [str(t) for t in source.fields["tokenizer.ggml.tokens"].contents()]
    rows = vocab_rows or len(tokens)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.chat_template"):
        field = source.fields.get(key)
        if field is not None:
            _copy_field(writer, key, field)
    rng = np.random.default_rng(seed)
    head_dim = hidden // HEADS
    shapes = {"token_embd.weight": ((rows, hidden), types["embed"]), "output_norm.weight": ((hidden,), T.F32),
              "output.weight": ((rows, hidden), types["head"])}
    for i in range(layers):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": ((hidden,), T.F32), b + "ffn_norm.weight": ((hidden,), T.F32),
                   b + "attn_q.weight": ((hidden, hidden), types["attn"]),
                   b + "attn_k.weight": ((KV_HEADS * head_dim, hidden), types["attn"]),
                   b + "attn_v.weight": ((KV_HEADS * head_dim, hidden), types["attn"]),
                   b + "attn_output.weight": ((hidden, hidden), types["attn"]),
                   b + "ffn_gate.weight": ((FFN, hidden), types["ffn"]),
                   b + "ffn_up.weight": ((FFN, hidden), types["ffn"]),
                   b + "ffn_down.weight": ((hidden, FFN), types["down"])}
        if arch == "qwen2":
            shapes |= {b + "attn_q.bias": ((hidden,), T.F32), b + "attn_k.bias": ((KV_HEADS * head_dim,), T.F32),
                       b + "attn_v.bias": ((KV_HEADS * head_dim,), T.F32)}
        if arch == "qwen3":
            shapes |= {b + "attn_q_norm.weight": ((head_dim,), T.F32), b + "attn_k_norm.weight": ((head_dim,), T.F32)}
    for name, (shape, kind) in shapes.items():
        writer.add_tensor(name, _values(rng, shape, kind, name.endswith("norm.weight")), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _values(rng, shape: tuple, kind, norm: bool) -> np.ndarray:
    """A tensor's stored form: float values, or quantized bytes [rows, bytes per row]."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    values = (np.ones(shape) if norm else rng.standard_normal(shape) * 0.1).astype(np.float32)
    if kind == T.F32:
        return values
    if kind in (T.Q4_K, T.Q5_K, T.Q6_K):
        block, nbytes = GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, nbytes), dtype=np.uint8)
        scale = (rng.random((shape[0], shape[1] // block)) * 0.002 + 0.0005).astype(np.float16).view(np.uint8)
        for at in ((208,) if kind == T.Q6_K else (0, 2)):
            raw[..., at:at + 2] = scale.reshape(shape[0], -1, 2)
        return raw.reshape(shape[0], -1)
    return quantize(values, kind)


def _copy_field(writer, key: str, field) -> None:
    from gguf import GGUFValueType

    value = field.contents()
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        writer.add_array(key, value)
    elif kind == GGUFValueType.STRING:
        writer.add_string(key, value)
    elif kind == GGUFValueType.BOOL:
        writer.add_bool(key, value)
    else:
        writer.add_uint32(key, int(value))
