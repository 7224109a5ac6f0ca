"""A checkpoint's tokenizer as Hugging Face files in a folder (what bundles carry), and whether two checkpoints share
a vocabulary.

A Hugging Face folder's files are copied; a GGUF's are written from its own vocabulary (models.gguf). Two
checkpoints share a vocabulary when their tokens are the same, id for id: a draft of a family whose embedding has
more padding rows than the target's (Qwen's 152,064 against 151,936) still proposes the same ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "config.json", "vocab.json", "merges.txt", "tokenizer.model")


def write_tokenizer_files(source: Path, folder: Path) -> list[str]:
    """The tokenizer of `source` (a .gguf file or a Hugging Face folder) into `folder`; returns the names written."""
    source, folder = Path(source), Path(folder)
    if source.suffix == ".gguf":
        from mirror_rt.models.gguf import write_gguf_tokenizer

        write_gguf_tokenizer(source, folder)
        return [n for n in TOKENIZER_FILES if n != "config.json" and (folder / n).is_file()]
    names = [n for n in TOKENIZER_FILES if (source / n).is_file()]
    for name in names:
        shutil.copyfile(source / name, folder / name)
    return names


def vocabulary(source: Path) -> list[str]:
    """The tokens of `source` by id (a GGUF's, without the trailing padding of its embedding: models.gguf_vocab; or
    tokenizer.json's model and added tokens)."""
    source = Path(source)
    if source.suffix == ".gguf":
        from mirror_rt.models.gguf_vocab import read_vocab

        vocab = read_vocab(source)
        return vocab.tokens[:vocab.size]
    tok = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = {i: t for t, i in tok["model"].get("vocab", {}).items()} if isinstance(tok["model"].get("vocab"), dict) \
        else dict(enumerate(t for t, *_ in tok["model"].get("vocab", [])))
    by_id.update((t["id"], t["content"]) for t in tok.get("added_tokens", []))
    return [by_id.get(i, "") for i in range(max(by_id, default=-1) + 1)]


def same_vocabulary(a: Path, b: Path) -> bool:
    """Whether checkpoints `a` and `b` name the same tokens with the same ids."""
    return vocabulary(a) == vocabulary(b)
