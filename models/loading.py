"""Resolve a model reference to a loaded `Transformer` and its tokenizer.

A reference is: nothing or `default` (the embedded SmolLM2), a Hugging Face folder
(`config.json` + safetensors), a `.gguf` file or a folder holding one (converted once into
the cache), or a preset name (`tiny`, `tiny-draft`: seeded random weights, byte tokenizer).
Errors are one-line `ModelError`s naming the path or architecture; nothing here decodes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mirror_rt.models.config import PRESETS, ModelConfig, UnsupportedArchitecture
from mirror_rt.models.default_model import (
    DEFAULT_MODEL,
    cache_dir,
    default_model_folder,
)
from mirror_rt.models.gguf import convert_gguf
from mirror_rt.models.tokenizer import ByteTokenizer, HFTokenizer
from mirror_rt.models.transformer import Transformer, random_model
from mirror_rt.runtime.values import error_line

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


class ModelError(ValueError):
    """A model reference that cannot be loaded (one-line message)."""


@dataclass
class LoadedCheckpoint:
    """A model, its tokenizer and where it came from."""

    model: Transformer  # eval mode, on CPU unless moved
    tokenizer: object  # HFTokenizer or ByteTokenizer
    source: str  # folder path or preset name


def load_checkpoint(ref: str | None = None, dtype: str = "float32", cache: str | None = None,
                    log=print) -> LoadedCheckpoint:
    """Load `ref` (see module docstring) with weights in `dtype`."""
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype '{dtype}' (known: {', '.join(DTYPES)})")
    if ref in PRESETS:
        model = random_model(ModelConfig.from_name(ref), seed=0, dtype=DTYPES[dtype], scale=20.0)
        return LoadedCheckpoint(model, ByteTokenizer(model.config.vocab_size), ref)
    if ref is not None and str(ref).endswith(".gguf") and Path(ref).expanduser().is_file():
        return _load_gguf(Path(ref).expanduser(), DTYPES[dtype], cache, log)
    folder = resolve_folder(ref, cache, log)
    config = read_config(folder)
    model = empty_model(config)  # every weight is read: _load_weights refuses a gap
    _load_weights(model, folder)
    return LoadedCheckpoint(model.to(DTYPES[dtype]).eval(), HFTokenizer(folder), str(folder))


def empty_model(config, dtype=torch.float32) -> Transformer:
    """A model of `config` on the CPU at `dtype`, its memory allocated but not initialized (no random weights drawn
    only to be overwritten), the LM head tied to the embedding where the config says so."""
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
    model = model.to_empty(device="cpu")
    if config.tie_embeddings:  # to_empty gives each of the two names its own tensor
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _load_gguf(path: Path, dtype, cache: str | None, log) -> LoadedCheckpoint:
    """A GGUF in torch: each tensor dequantized on its own into a model allocated once at `dtype` (no float32 copy
    of the whole model); the tokenizer from the file's own vocabulary, kept in the cache."""
    from mirror_rt.models.gguf import write_gguf_tokenizer
    from mirror_rt.models.gguf_file import GGUFModel
    from mirror_rt.models.memory import check_fits, out_of_memory
    from mirror_rt.models.weights import HF_LAYER_NAMES, HF_TOP_NAMES

    source = GGUFModel(path)
    c = source.config
    params = sum(t.rows * t.columns for t in source.tensors.values() if t.name != "rope_freqs")
    needed = params * torch.finfo(dtype).bits // 8
    what = f"{path.name} in torch at {str(dtype).removeprefix('torch.')}"
    check_fits(needed, what)
    try:
        model = empty_model(c, dtype)
    except RuntimeError as exc:  # torch's "can't allocate memory"
        raise out_of_memory(what, needed) from exc
    names = {v: k.removeprefix("model.") for k, v in HF_TOP_NAMES.items()}
    names |= {f"layers.{i}.{v}": f"layers.{i}.{k}" for i in range(c.n_layers) for k, v in HF_LAYER_NAMES.items()}
    state = dict(model.named_parameters())
    with torch.no_grad():
        for name in source.tensors:
            if name in names and names[name] in state:
                state[names[name]].copy_(torch.from_numpy(source.array(name)).reshape(state[names[name]].shape))
    folder = _gguf_tokenizer_folder(path, cache)
    if not (folder / "tokenizer.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        write_gguf_tokenizer(path, folder)
    return LoadedCheckpoint(model.eval(), HFTokenizer(folder), str(path))


def _gguf_tokenizer_folder(gguf: Path, cache: str | None) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir(cache) / "tokenizers" / f"{gguf.stem}-{key}"


def resolve_folder(ref: str | None, cache: str | None = None, log=print) -> Path:
    """A Hugging Face folder for `ref`, converting a GGUF file into the cache if needed."""
    if ref in (None, "", "default", DEFAULT_MODEL):
        return default_model_folder(cache, log=log)
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelError(f"model not found: {ref} (expected a Hugging Face folder, a .gguf file "
                         f"or a preset: default, {', '.join(PRESETS)})")
    if path.is_dir() and (path / "config.json").exists():
        return path
    ggufs = [path] if path.suffix == ".gguf" else sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) != 1:
        raise ModelError(f"not a model: {ref} (no config.json, and not exactly one .gguf file)")
    return _converted_gguf(ggufs[0], cache, log)


def _converted_gguf(gguf: Path, cache: str | None, log) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir(cache) / "models" / f"{gguf.stem}-{key}"
    if (folder / "config.json").exists():
        return folder
    return convert_gguf(gguf, folder, log=log)


def read_config(folder: Path) -> ModelConfig:
    """Parse `folder/config.json`, refusing unsupported architectures."""
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {folder / 'config.json'}: {exc}") from None
    try:
        return ModelConfig.from_hf(hf)
    except UnsupportedArchitecture as exc:
        raise ModelError(f"{folder}: {exc}") from None
    except (KeyError, ValueError) as exc:
        raise ModelError(f"{folder / 'config.json'}: bad or missing field {exc}") from None


def _load_weights(model: Transformer, folder: Path) -> None:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no .safetensors weights in {folder}")
    state = {}
    for f in files:
        try:
            tensors = load_file(f)
        except Exception as exc:  # noqa: BLE001 -- a truncated or corrupt file (safetensors' own error type)
            raise ModelError(f"cannot read {f}: {error_line(exc)}") from None
        for name, tensor in tensors.items():
            state[name.removeprefix("model.")] = tensor
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    expected = model.state_dict()
    wrong = [f"{k} is {list(v.shape)} in the weights, {list(expected[k].shape)} by the config"
             for k, v in state.items() if k in expected and v.shape != expected[k].shape]
    if wrong:
        raise ModelError(f"{folder}: weights do not match the config: {wrong[0]}"
                         + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and model.config.tie_embeddings)]
    if missing or result.unexpected_keys:
        raise ModelError(f"{folder}: weights do not match the config (missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]})")
