"""Tokenizers behind one small interface: encode, decode, chat prompt, end ids, fingerprint.

`HFTokenizer` wraps a Hugging Face fast tokenizer folder; `ByteTokenizer` maps bytes to
ids (tests and tiny presets, no files). The runtime only sees this interface, so it never
depends on transformers' tokenizer classes directly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


class HFTokenizer:
    """A Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json)."""

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        self.folder = Path(folder)
        self._tok = AutoTokenizer.from_pretrained(self.folder)
        self.vocab_size = len(self._tok)
        self.eos_token_ids = tuple(i for i in {self._tok.eos_token_id} if i is not None)
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
        specials = {self._tok.bos_token_id, *self._tok.all_special_ids, *self.eos_token_ids}
        self.special_ids = tuple(sorted(i for i in specials if i is not None))  # bos, eos, chat markers...

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (else the server describes them)."""
        return "tools" in str(getattr(self._tok, "chat_template", None) or "")

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` under the chat template, ready for the assistant turn (with `tools` where
        the template renders them)."""
        text = self._tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=True)
        return self.encode(text)

    def sha256(self) -> str:
        """Fingerprint of the vocabulary: equal for tokenizers that map text to the same ids."""
        path = self.folder / "tokenizer.json"
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


class ByteTokenizer:
    """UTF-8 bytes shifted by 2; id 0 = pad, id 1 = end. Vocabulary 258 (or more if padded)."""

    def __init__(self, vocab_size: int = 258):
        self.vocab_size = vocab_size
        self.eos_token_ids = (1,)
        self.special_ids = (0, 1)
        self.has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return [b + 2 for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        data = bytes(i - 2 for i in ids if 2 <= i < 258)
        return data.decode("utf-8", errors="replace")

    renders_tools = False

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode("".join(m["content"] or "" for m in messages))

    def token_bytes(self) -> list[bytes]:
        """The bytes of ids 0..257 (the table a grammar engine reads; the two specials are named; padding ids
        beyond 257 have none)."""
        return [b"<pad>", b"<end>"] + [bytes([i]) for i in range(256)]

    def sha256(self) -> str:
        return hashlib.sha256(f"bytes:{self.vocab_size}".encode()).hexdigest()
