"""Convert a GGUF file into a Hugging Face safetensors folder.

The weights are dequantized by transformers' GGUF loader; the tokenizer is built from the file's own metadata
(models/gguf_vocab.py: llama.cpp's rules for its tokenizer kind and pre-tokenizer, its special tokens, BOS/EOS
and chat template), never from transformers' GGUF tokenizer conversion, which loses them for Qwen2 and SmolLM2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mirror_rt.models.gguf_vocab import VocabError, read_vocab, write_tokenizer
from mirror_rt.models.partials import partial_folder, sweep_partials
from mirror_rt.runtime.values import error_line


def convert_gguf(gguf_path: Path, out_dir: Path, log=print) -> Path:
    """Dequantize `gguf_path` into a safetensors folder `out_dir` (atomically); returns it."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    sweep_partials(out_dir)  # what a conversion killed mid-way left
    tmp = partial_folder(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        log(f"converting {gguf_path.name} to safetensors (one time)...")
        vocab, model = _read_gguf(gguf_path)
        model.save_pretrained(tmp, safe_serialization=True)
        write_tokenizer(gguf_path, tmp, vocab)  # after config.json, whose bos/eos/pad ids it sets
        if _complete(out_dir):  # another process converted it meanwhile: keep its folder (it may be reading it)
            return out_dir
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def write_gguf_tokenizer(gguf_path: Path, folder: Path) -> None:
    """The GGUF's tokenizer as Hugging Face files in `folder` (models.gguf_vocab; its weights are not read)."""
    gguf_path = Path(gguf_path)
    _readable(gguf_path, lambda: write_tokenizer(gguf_path, folder))


def _read_gguf(gguf_path: Path) -> tuple:
    """(vocabulary, model) of a GGUF file, the model through transformers; a one-line ValueError naming the file
    for one it cannot read (cut short, not GGUF), of a family mirror-rt does not run, with a tokenizer it cannot
    build, or lacking weights (transformers would fill them with random numbers: another model, silently)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mirror_rt.models.config import SUPPORTED_ARCHITECTURES, _unsupported_message

    where, name = gguf_path.parent, gguf_path.name
    arch = _readable(gguf_path, lambda: AutoConfig.from_pretrained(where, gguf_file=name).model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf_path}: {_unsupported_message(arch)}")
    vocab = _readable(gguf_path, lambda: read_vocab(gguf_path))
    model, loading = _readable(gguf_path, lambda: AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, output_loading_info=True))
    missing = [key for key in loading["missing_keys"] if not (key == "lm_head.weight" and
                                                                model.config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"{gguf_path} lacks weights the model needs: {', '.join(missing[:3])}"
                         + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""))
    return vocab, model


def _readable(gguf_path: Path, read):
    """`read()`, or a one-line ValueError naming the file (transformers and gguf raise many kinds for one they
    cannot read)."""
    try:
        return read()
    except VocabError:  # read fine, but of a tokenizer mirror-rt cannot build: its own message
        raise
    except Exception as exc:  # noqa: BLE001
        if _out_of_memory(exc):  # the machine's limit, not the file's fault
            raise
        raise ValueError(f"cannot read {gguf_path} (cut short, or not a GGUF model?): {error_line(exc)}") from None


def _out_of_memory(exc: BaseException) -> bool:
    from mirror_rt.models.memory import out_of_memory_error

    return out_of_memory_error(exc)


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
