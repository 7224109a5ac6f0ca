"""Tokenizers behind one small interface: encode, decode, chat prompt, end ids, fingerprint.

`HFTokenizer` (a Hugging Face folder through `tokenizers`, its chat template through jinja2: the ids of
transformers' fast tokenizers; transformers itself only for folders whose tokenizer adds Python rules) and
`ByteTokenizer` (tests). The runtime sees only this interface.
Design notes: docs/design/models.md
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from mirror_rt.models import chat_template
from mirror_rt.runtime.values import error_line

# tokenizer classes whose fast tokenizer is tokenizer.json as saved (no Python-side rules on load)
PLAIN_CLASSES = ("PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast", "Qwen2Tokenizer",
                 "Qwen2TokenizerFast")
# files a tokenizer is built from (transformers reads the others beside one of these)
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
# transformers' clean_up_tokenization (applied on decode where tokenizer_config asks for it)
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class HFTokenizer:
    """A Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        config_path = self.folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        self._tok = _backend(self.folder, config)
        self._tok.no_truncation()  # as transformers: a tokenizer.json's truncation or padding never applies
        self._tok.no_padding()
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        self._specials = chat_template.special_tokens(self.folder, config)
        _add_missing_tokens(self._tok, config, self._specials)
        source = chat_template.read_template(self.folder, config)
        self._template = chat_template.compile_template(source) if source else None
        self._template_source = source or ""
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = _end_ids(self.folder, self._id("eos_token"), self.vocab_size)
        self.has_chat_template = self._template is not None
        named = [v for values in self._specials.values() for v in (values if isinstance(values, list) else [values])]
        specials = {self._id("bos_token"), *(self._tok.token_to_id(t) for t in named), *self.eos_token_ids}
        self.special_ids = tuple(sorted(i for i in specials if i is not None))  # bos, eos, chat markers...

    def _id(self, key: str) -> int | None:
        token = self._specials.get(key)
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, what the tokenizer adds around a whole prompt (a BOS where
        its post-processor asks for one: Llama's, as transformers, vLLM and llama.cpp tokenize a prompt)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def info(self) -> dict:
        """What the tokenizer is, as vLLM's `/tokenizer_info` tells it: its special tokens by name (None where it
        has none) and its chat template's source (None without one)."""
        named = {key: self._specials.get(key) for key in chat_template.SPECIAL_TOKEN_KEYS}
        return {"tokenizer_class": "PreTrainedTokenizerFast", **named,
                "chat_template": self._template_source or None}

    def token_names(self, ids) -> list[str]:
        """The vocabulary's names of `ids` (byte-level BPE's 'Ġword', added tokens as written)."""
        return [self._tok.id_to_token(int(i)) for i in ids]

    def decode(self, ids) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=True)
        if self._clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token stands for (one more than its longest decoded text, for decoders that
        drop a word's leading space): a text of n characters has at least n / this many tokens."""
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        return 1 + max((len(self._tok.decode([i], skip_special_tokens=False)) for i in ids), default=1)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (else the server describes them)."""
        return self._template is not None and "tools" in self._template_source

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` under the chat template, ready for the assistant turn (with `tools` where
        the template renders them)."""
        if self._template is None:
            raise ValueError(f"{self.folder} has no chat template (send plain text, or a folder with one)")
        return self.encode(chat_template.render(self._template, messages, self._specials, tools=tools))

    def sha256(self) -> str:
        """Fingerprint of the vocabulary: equal for tokenizers that map text to the same ids."""
        path = self.folder / "tokenizer.json"
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def _end_ids(folder: Path, eos: int | None, vocab_size: int) -> tuple[int, ...]:
    """The ids that end a generation: the tokenizer's EOS, then generation_config.json's `eos_token_id` (one or
    a list: Llama 3's end of turn and of message, a GGUF's eot/eom), each inside the vocabulary."""
    ids = [eos]
    path = folder / "generation_config.json"
    if path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            saved = None
        ids += saved if isinstance(saved, list) else [saved]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and 0 <= i < vocab_size))


def _add_missing_tokens(tok, config: dict, specials: dict) -> None:
    """Register what transformers registers on load: `added_tokens_decoder` entries the backend lacks, and
    special tokens that are not added tokens yet, as special (so decode skips them, encode keeps them whole)."""
    from tokenizers import AddedToken

    named = [v for values in specials.values() for v in (values if isinstance(values, list) else [values])]
    known = tok.get_added_tokens_decoder().values()
    present = {repr(t) for t in known}
    saved = sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda item: int(item[0]))
    to_add = [token for token in (AddedToken(**fields) for _, fields in saved) if repr(token) not in present]
    have = {t.content for t in known} | {t.content for t in to_add}
    to_add += [AddedToken(name, special=True) for name in dict.fromkeys(named) if name not in have]
    for token in to_add:
        token.special = token.special or token.content in named
    if to_add:
        tok.add_tokens(to_add)


def _backend(folder: Path, config: dict):
    """The folder's `tokenizers.Tokenizer`, as transformers would set it up: read directly for tokenizer
    classes that add nothing in Python (PLAIN_CLASSES), else taken from transformers itself."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if path.is_file() and config.get("tokenizer_class") in PLAIN_CLASSES:
        tok = Tokenizer.from_file(str(path))
        _match_prefix_space(tok, bool(config.get("add_prefix_space", False)))
        return tok
    if not any((folder / name).is_file() for name in TOKENIZER_SOURCES):
        raise ValueError(f"no tokenizer in {folder} (expected {' or '.join(TOKENIZER_SOURCES[:2])})")
    from transformers import AutoTokenizer  # other classes (Llama's, sentencepiece folders) adjust it on load

    try:
        fast = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 -- transformers raises many kinds for a folder it cannot read
        raise ValueError(f"{folder}: transformers cannot load its tokenizer ({type(exc).__name__}: "
                         f"{error_line(exc)})") from None
    if not hasattr(fast, "backend_tokenizer"):
        raise ValueError(f"{folder}: transformers has no fast tokenizer for it")
    return fast.backend_tokenizer


def _match_prefix_space(tok, add_prefix_space: bool) -> None:
    """transformers sets a single pre-tokenizer's `add_prefix_space` to the config's (default False)."""
    from tokenizers import pre_tokenizers

    state = json.loads(tok.pre_tokenizer.__getstate__()) if tok.pre_tokenizer is not None else {}
    if state.get("add_prefix_space", add_prefix_space) == add_prefix_space:
        return
    state["add_prefix_space"] = add_prefix_space
    kind = getattr(pre_tokenizers, state.pop("type"))
    tok.pre_tokenizer = kind(**state)


class ByteTokenizer:
    """UTF-8 bytes shifted by 2; id 0 = pad, id 1 = end. Vocabulary 258 (or more if padded)."""

    def __init__(self, vocab_size: int = 258):
        self.vocab_size = vocab_size
        self.eos_token_ids = (1,)
        self.special_ids = (0, 1)
        self.has_chat_template = False

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + 2 for b in text.encode("utf-8")]  # nothing is added around a prompt

    def info(self) -> dict:
        """No special token has a text here (the end is id 1 alone), and there is no chat template."""
        return {"tokenizer_class": "ByteTokenizer", "bos_token": None, "eos_token": None, "pad_token": None,
                "chat_template": None}

    def token_names(self, ids) -> list[str]:
        names = self.token_bytes()
        return [names[i].decode("latin-1") if i < len(names) else f"<unused{i}>" for i in ids]

    def decode(self, ids) -> str:
        data = bytes(i - 2 for i in ids if 2 <= i < 258)
        return data.decode("utf-8", errors="replace")

    renders_tools = False
    longest_token_chars = 1  # a byte: one character at most

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode("".join(m["content"] or "" for m in messages))

    def token_bytes(self) -> list[bytes]:
        """The bytes of ids 0..257 (the table a grammar engine reads; the two specials are named; padding ids
        beyond 257 have none)."""
        return [b"<pad>", b"<end>"] + [bytes([i]) for i in range(256)]

    def sha256(self) -> str:
        return hashlib.sha256(f"bytes:{self.vocab_size}".encode()).hexdigest()
