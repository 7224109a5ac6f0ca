"""Convert a GGUF file into a Hugging Face safetensors folder, repairing the tokenizer.

transformers' GGUF loader dequantizes the weights correctly but writes wrong tokenizer
settings for byte-level BPE models such as SmolLM2: `<|im_start|>` as both BOS and EOS, a
BOS added to every encoding, and a ByteFallback/Fuse/Replace decoder of SentencePiece
models. The chat template then doubles the BOS and the model answers garbage, and
openvino-tokenizers cannot convert that tokenizer.json. `repair_tokenizer` restores the
byte-level pipeline (digits split individually, ByteLevel decoder and post-processor, no
BOS added, no byte fallback) and the end/pad tokens, keeping every token id unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mirror_rt.models.partials import partial_folder, sweep_partials
from mirror_rt.runtime.values import error_line

# Pre-tokenizer of SmolLM2 / StarCoder-style byte-level BPE: one digit per pre-token.
_BYTE_LEVEL_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
_BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                       "use_regex": True}
_BYTE_LEVEL_POST = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                    "use_regex": True}


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
        tokenizer, model = _read_gguf(gguf_path)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if is_byte_level_bpe(tmp / "tokenizer.json"):
            repair_tokenizer(tmp)
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
    """The GGUF's tokenizer as Hugging Face files in `folder` (its weights are not read)."""
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    tokenizer = _readable(gguf_path, lambda: AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name))
    tokenizer.save_pretrained(folder)
    if is_byte_level_bpe(Path(folder) / "tokenizer.json"):
        repair_tokenizer(folder)


def _read_gguf(gguf_path: Path) -> tuple:
    """(tokenizer, model) of a GGUF file through transformers; a one-line ValueError naming the file for one it
    cannot read (cut short, not GGUF), of a family mirror-rt does not run, or lacking weights (transformers would
    fill them with random numbers: another model, silently)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mirror_rt.models.config import SUPPORTED_ARCHITECTURES, _unsupported_message

    where, name = gguf_path.parent, gguf_path.name
    arch = _readable(gguf_path, lambda: AutoConfig.from_pretrained(where, gguf_file=name).model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf_path}: {_unsupported_message(arch)}")
    tokenizer = _readable(gguf_path, lambda: AutoTokenizer.from_pretrained(where, gguf_file=name))
    model, loading = _readable(gguf_path, lambda: AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, output_loading_info=True))
    missing = [key for key in loading["missing_keys"] if not (key == "lm_head.weight" and
                                                                model.config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"{gguf_path} lacks weights the model needs: {', '.join(missing[:3])}"
                         + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""))
    return tokenizer, model


def _readable(gguf_path: Path, read):
    """`read()`, or a one-line ValueError naming the file (transformers and gguf raise many kinds for one they
    cannot read)."""
    try:
        return read()
    except Exception as exc:  # noqa: BLE001
        if _out_of_memory(exc):  # the machine's limit, not the file's fault
            raise
        raise ValueError(f"cannot read {gguf_path} (cut short, or not a GGUF model?): {error_line(exc)}") from None


def _out_of_memory(exc: BaseException) -> bool:
    from mirror_rt.models.memory import out_of_memory_error

    return out_of_memory_error(exc)


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def is_byte_level_bpe(tokenizer_json: Path) -> bool:
    """True when the vocabulary is GPT-2 style byte-level (tokens spelled with 'Ġ')."""
    vocab = json.loads(Path(tokenizer_json).read_text())["model"].get("vocab", {})
    return any(token.startswith("Ġ") for token in list(vocab)[:5000])


def repair_tokenizer(folder: Path) -> None:
    """Rewrite tokenizer.json / tokenizer_config.json / config files of a byte-level BPE model."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["normalizer"] = None
    tok["pre_tokenizer"] = _BYTE_LEVEL_PRE_TOKENIZER
    tok["post_processor"] = _BYTE_LEVEL_POST
    tok["decoder"] = _BYTE_LEVEL_DECODER
    tok["model"]["byte_fallback"] = False
    tok["model"]["fuse_unk"] = False
    path.write_text(json.dumps(tok, ensure_ascii=False, indent=1))
    end = _end_token(tok)
    _repair_tokenizer_config(folder, end)
    _repair_model_config(folder, tok, end)


def _end_token(tok: dict) -> str:
    """The chat end token (`<|im_end|>` for ChatML models), else `<|endoftext|>`."""
    added = {t["content"] for t in tok.get("added_tokens", [])}
    for name in ("<|im_end|>", "<|endoftext|>", "</s>"):
        if name in added:
            return name
    raise ValueError("cannot repair tokenizer: no end-of-text token among its added tokens")


def _repair_tokenizer_config(folder: Path, end: str) -> None:
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(add_bos_token=False, add_eos_token=False, eos_token=end, pad_token=end,
               tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False)
    cfg.pop("legacy", None)
    cfg.pop("add_prefix_space", None)
    path.write_text(json.dumps(cfg, ensure_ascii=False, indent=2))
    special = folder / "special_tokens_map.json"
    if special.exists():
        sm = json.loads(special.read_text())
        sm.update(eos_token=end, pad_token=end)
        special.write_text(json.dumps(sm, indent=2))


def _repair_model_config(folder: Path, tok: dict, end: str) -> None:
    end_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == end)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg.update(eos_token_id=end_id, pad_token_id=end_id)
            path.write_text(json.dumps(cfg, indent=2))
