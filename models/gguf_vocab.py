"""A GGUF file's tokenizer as a Hugging Face tokenizer folder, built from the file's own metadata.

llama.cpp's tokenization of the same file is the reference: `tokenizer.ggml.model` picks the algorithm
(`gpt2` byte-level BPE with the pre-tokenizer of `tokenizer.ggml.pre`; `llama` SentencePiece BPE with byte fallback),
special tokens match whole before any splitting, BOS/EOS/EOT are the file's, and every token keeps its id; a
special token past the embedding's rows is refused (the model could never emit it).
Design notes: docs/design/models.md
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp treats these names as control tokens whatever their type says (its end-of-turn, end-of-generation
# and fill-in-the-middle detection by text)
_CONTROL_NAMES = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "<｜end▁of▁sentence｜>", "<|eom_id|>", "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>",
    "<PRE>", "▁<PRE>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|fim_pad|>",
    "<fim-pad>", "<fim_pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "</s>", "[EOT]", "[EOS]",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "[e~[",
))
# ... and these as user-defined (matched whole, kept in decoded text)
_USER_DEFINED_NAMES = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+"
           r"((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # llama.cpp's form
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


class VocabError(ValueError):
    """A GGUF file read fine whose tokenizer mirror-rt cannot build (none, or a kind not covered): one line."""


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text for one group of `tokenizer.ggml.pre` values."""

    regexes: tuple[str, ...]  # applied in turn, each splitting the pieces of the one before (matches isolated)
    ignore_merges: bool = False  # a pre-token that is a whole token is taken as one
    add_bos: bool = False  # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token
    clean_spaces: bool = True  # decode's clean-up of spaces before punctuation (transformers' clean_up_...)


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,), clean_spaces=False)
_SMOLLM_PRE = PreTokenizer((r"\p{N}", _GPT2), clean_spaces=False)
PRE_TOKENIZERS = {
    "default": PreTokenizer(_DEFAULT),
    "gpt-2": PreTokenizer((_GPT2,)),
    "llama3": _LLAMA3_PRE, "llama-v3": _LLAMA3_PRE, "llama-bpe": _LLAMA3_PRE,
    "qwen2": _QWEN2_PRE, "deepseek-r1-qwen": _QWEN2_PRE,
    "smollm": _SMOLLM_PRE, "starcoder": PreTokenizer((r"\p{N}", _GPT2)),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True, clean_spaces=False),
}


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer keys of a GGUF file (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""

    path: str  # the file, for messages
    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str  # the pre-tokenizer's name ("" for SentencePiece)
    tokens: list[str]  # id -> text (a byte-level BPE's 'Ġ'-spelled, SentencePiece's '▁'-spelled)
    types: list[int]  # id -> NORMAL, CONTROL, ...
    scores: list[float]  # id -> score (SentencePiece merge priority)
    merges: list[tuple[str, str]]  # byte-level BPE merges, highest priority first
    special: dict[str, int] = field(default_factory=dict)  # bos/eos/eot/eom/unk/pad -> id (inside the vocabulary)
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True  # SentencePiece: '▁' before each stretch of text
    chat_template: str | None = None
    embedding_rows: int | None = None  # token_embd.weight's rows (None: no such tensor)

    @property
    def size(self) -> int:
        """The tokens the tokenizer keeps: all but a trailing run of unused ones (the padding of an embedding
        rounded up, Qwen's `[PAD151665]`...), so that files padded to other sizes share one tokenizer.json."""
        size = len(self.tokens)
        while size > 0 and self.types[size - 1] == UNUSED:
            size -= 1
        return size

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The ids that end a generation: eos, then eot and eom where the file names them."""
        return tuple(dict.fromkeys(self.special[k] for k in ("eos", "eot", "eom") if k in self.special))

    def is_special(self, token_id: int) -> bool:
        """Whether llama.cpp matches the token whole in text (control, user-defined, unknown, or named so)."""
        token = self.tokens[token_id]
        return (self.types[token_id] in (UNKNOWN, CONTROL, USER_DEFINED) or token in _CONTROL_NAMES
                or token in _USER_DEFINED_NAMES)

    def is_user_defined(self, token_id: int) -> bool:
        """A special token that decoding keeps (user-defined: `<think>`), not skips (control: `<|im_end|>`)."""
        token = self.tokens[token_id]
        return token in _USER_DEFINED_NAMES or (self.types[token_id] == USER_DEFINED and token not in _CONTROL_NAMES)


def read_vocab(source) -> GGUFVocab:
    """The tokenizer of a GGUF file (a path, or an open gguf.GGUFReader); VocabError for a file without one, or
    of a tokenizer kind or pre-tokenizer the rules here do not cover (gguf's own errors for one it cannot read)."""
    from gguf import GGUFReader

    reader = source if isinstance(source, GGUFReader) else GGUFReader(str(source))
    path = str(getattr(reader.data, "filename", "GGUF file")) if reader is source else str(source)

    def value(key, default=None):
        found = reader.fields.get(key)
        return found.contents() if found is not None else default

    model, pre = value("tokenizer.ggml.model"), value("tokenizer.ggml.pre", "") or ""
    tokens = value("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise VocabError(f"{path} has no tokenizer (tokenizer.ggml.model / tokens)")
    if model not in ("gpt2", "llama"):
        raise VocabError(f"{path}: tokenizer kind '{model}' is not supported (supported: gpt2, llama)")
    if model == "gpt2" and (pre or "default") not in PRE_TOKENIZERS:
        raise VocabError(f"{path}: pre-tokenizer '{pre}' is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for an empty token
    n = len(tokens)
    types = list(value("tokenizer.ggml.token_type", [NORMAL] * n))[:n]
    scores = [float(s) for s in value("tokenizer.ggml.scores", [0.0] * n)][:n]
    merges = [_split_merge(m) for m in value("tokenizer.ggml.merges", [])]
    if model == "gpt2" and not merges:
        raise VocabError(f"{path}: byte-level BPE tokenizer without merges (tokenizer.ggml.merges)")
    special = _special_ids(value, model, n)
    rules = PRE_TOKENIZERS.get(pre or "default") if model == "gpt2" else None
    default_bos = rules.add_bos if rules else True
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    return GGUFVocab(
        path=path, model=model, pre=pre if model == "gpt2" else "", tokens=tokens, types=types, scores=scores,
        merges=merges, special=special, add_bos=bool(value("tokenizer.ggml.add_bos_token", default_bos)),
        add_eos=bool(value("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(value("tokenizer.ggml.add_space_prefix", model == "llama")),
        chat_template=value("tokenizer.chat_template"),
        embedding_rows=int(embedding.shape[-1]) if embedding is not None else None)


def _split_merge(merge: str) -> tuple[str, str]:
    """'a b' -> ('a', 'b'), split at the first space after the first character (as llama.cpp)."""
    cut = merge.find(" ", 1)
    return (merge[:cut], merge[cut + 1:]) if cut >= 0 else (merge, "")


def _special_ids(value, model: str, n: int) -> dict[str, int]:
    """bos/eos/eot/eom/unk/pad ids from the file (llama.cpp's SentencePiece defaults 1/2/0 where it names none);
    an id outside the vocabulary counts as absent, as in llama.cpp."""
    defaults = {"bos": 1, "eos": 2, "unk": 0} if model == "llama" else {}
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id",
            "unk": "unknown_token_id", "pad": "padding_token_id"}
    ids = {}
    for name, key in keys.items():
        found = value(f"tokenizer.ggml.{key}")
        for candidate in (found, defaults.get(name)):
            if candidate is not None and 0 <= int(candidate) < n:
                ids[name] = int(candidate)
                break
    return ids


def build_tokenizer(vocab: GGUFVocab):
    """The `tokenizers.Tokenizer` that splits text as llama.cpp does for `vocab` (module docstring)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer(_bpe(vocab))
    if vocab.model == "llama":
        _sentencepiece_pipeline(tok, vocab)
    else:
        _byte_level_pipeline(tok, vocab)
    tok.add_tokens([AddedToken(vocab.tokens[i], special=not vocab.is_user_defined(i), normalized=False)
                    for i in _special_token_ids(vocab)])
    return tok


def _special_token_ids(vocab: GGUFVocab) -> list[int]:
    return [i for i in range(vocab.size) if vocab.is_special(i)]


def _bpe(vocab: GGUFVocab):
    from tokenizers import models

    ids = {token: i for i, token in enumerate(vocab.tokens[:vocab.size])}
    unk = vocab.tokens[vocab.special["unk"]] if "unk" in vocab.special else None
    if vocab.model == "llama":
        return models.BPE(ids, _sentencepiece_merges(vocab, ids), unk_token=unk, byte_fallback=True, fuse_unk=True)
    rules = PRE_TOKENIZERS[vocab.pre or "default"]
    merges = [m for m in vocab.merges if m[0] + m[1] in ids]  # none makes a padding token
    return models.BPE(ids, merges, unk_token=unk, ignore_merges=rules.ignore_merges)


def _sentencepiece_merges(vocab: GGUFVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the token's score deciding the order (llama.cpp merges the
    adjacent pair whose joined text is the highest-scoring token)."""
    found = []
    for token, i in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-vocab.scores[i], i, cut, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece_pipeline(tok, vocab: GGUFVocab) -> None:
    from tokenizers import decoders, normalizers

    prefix = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    post = _added_bos_eos(vocab)
    if post is not None:
        tok.post_processor = post


def _byte_level_pipeline(tok, vocab: GGUFVocab) -> None:
    from tokenizers import Regex, decoders, pre_tokenizers, processors

    regexes = PRE_TOKENIZERS[vocab.pre or "default"].regexes
    use_regex = regexes[-1] == _GPT2  # GPT-2's split is ByteLevel's own (as SmolLM2's and StarCoder's tokenizer.json)
    splits = regexes[:-1] if use_regex else regexes
    if splits == (r"\p{N}",):
        splits = [pre_tokenizers.Digits(individual_digits=True)]
    else:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=use_regex, use_regex=use_regex)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    post = _added_bos_eos(vocab)
    tok.post_processor = processors.ByteLevel(trim_offsets=False) if post is None else processors.Sequence(
        [processors.ByteLevel(trim_offsets=False), post])


def _added_bos_eos(vocab: GGUFVocab):
    """The post-processor adding BOS / EOS where the file asks for them (encode with special tokens)."""
    from tokenizers import processors

    ends = [(key, vocab.special[key]) for key, wanted in (("bos", vocab.add_bos), ("eos", vocab.add_eos))
            if wanted and key in vocab.special]
    if not ends:
        return None
    names = dict(ends)
    single = " ".join([*([f"{vocab.tokens[names['bos']]}:0"] if "bos" in names else []), "$A:0",
                       *([f"{vocab.tokens[names['eos']]}:0"] if "eos" in names else [])])
    pair = single + " " + single.replace("$A:0", "$B:1").replace(":0", ":1")
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(vocab.tokens[i], i) for _, i in ends])


def write_tokenizer(gguf_path, out_dir, vocab: GGUFVocab | None = None) -> GGUFVocab:
    """Write the GGUF file's tokenizer into `out_dir` as a Hugging Face tokenizer folder: tokenizer.json,
    tokenizer_config.json (chat template, bos/eos/unk/pad tokens, add_bos_token / add_eos_token),
    special_tokens_map.json, and the end ids (eos, eot, eom) in generation_config.json; a config.json already
    there gets the same bos/eos/pad ids. Returns the vocabulary read (`vocab`: one already read)."""
    vocab = vocab or read_vocab(gguf_path)
    _check_embedding(vocab)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # written as models/gguf.py's earlier repair wrote it: SmolLM2's file keeps its bytes (and fingerprint)
    text = json.dumps(json.loads(build_tokenizer(vocab).to_str()), ensure_ascii=False, indent=1)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    names = {f"{key}_token": vocab.tokens[i] for key, i in vocab.special.items() if key in ("bos", "eos", "unk", "pad")}
    if "pad_token" not in names and "eos_token" in names:
        names["pad_token"] = names["eos_token"]
    clean = vocab.model == "gpt2" and PRE_TOKENIZERS[vocab.pre or "default"].clean_spaces
    added = {str(i): {"content": vocab.tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": not vocab.is_user_defined(i)} for i in _special_token_ids(vocab)}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "add_bos_token": vocab.add_bos,
              "add_eos_token": vocab.add_eos, "clean_up_tokenization_spaces": clean, "added_tokens_decoder": added}
    if vocab.chat_template:
        config["chat_template"] = vocab.chat_template
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", names)
    _set_token_ids(out / "generation_config.json", vocab, create=True)
    _set_token_ids(out / "config.json", vocab, create=False)
    return vocab


def _check_embedding(vocab: GGUFVocab) -> None:
    """A VocabError naming the token where a named special token lies past the embedding's rows."""
    rows = vocab.embedding_rows
    for key, i in vocab.special.items():
        if rows is not None and i >= rows:
            raise VocabError(f"{vocab.path}: its {key} token {vocab.tokens[i]!r} (id {i}) is past the model's "
                             f"{rows} embedding rows")


def _set_token_ids(path: Path, vocab: GGUFVocab, create: bool) -> None:
    """bos/eos/pad ids into a JSON config (eos: the end ids, a list where there are several)."""
    if not path.is_file() and not create:
        return
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    ends = list(vocab.end_ids)
    pad = vocab.special.get("pad", ends[0] if ends else None)
    config.update(bos_token_id=vocab.special.get("bos"), eos_token_id=ends[0] if len(ends) == 1 else ends or None,
                  pad_token_id=pad)
    _write_json(path, config)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=2), encoding="utf-8")
