"""Grammars for constrained decoding: what a request must match, compiled for llguidance.

`check` says why a grammar cannot run (the one line a 400 shows). It knows no model and no decoder.
Invariant: a masked row keeps the raw value of every allowed token and -inf everywhere else.
Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mirror_rt.runtime.schema_finite import unending
from mirror_rt.runtime.transfer import import_torch

if TYPE_CHECKING:
    import torch

JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", type(None): "null"}
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# compact JSON as OpenAI writes it: no free whitespace, so a small model cannot loop on newlines, and
# the separators are forced tokens (free drafts)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match."""

    kind: str  # json_schema | json_object | regex | choice | grammar
    spec: str = ""  # the schema as JSON text, the regex, the choices as a JSON list, or a Lark/GBNF grammar

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint '{self.kind}' (choose from {', '.join(KINDS)})")

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls("choice", json.dumps(list(options)))

    def grammar(self) -> str:
        """llguidance's grammar text; ValueError when the spec is malformed (not JSON, a bad choice list)."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            schema = _json(self.spec, "a JSON schema")
            if schema is False:  # true and false are schemas too: any value, and none
                raise ValueError("the JSON schema false admits no output")
            schema = {} if schema is True else schema
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is an object, not a JSON {JSON_TYPES.get(type(schema), 'value')}")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            reason = llguidance.LLMatcher.validate_grammar(grammar)  # the schema's own fault first ("Invalid type")
            if reason and not reason.startswith("WARNING"):
                raise ValueError(one_line(reason))
            where = unending(schema)
            if where is not None:
                raise ValueError(f"the JSON schema has no finite instance: a value of {where} must always hold "
                                 f"another (an answer could never end)")
            return grammar
        if self.kind == "choice":
            options = _json(self.spec, "a list of strings")
            if not (isinstance(options, list) and options and all(isinstance(o, str) for o in options)):
                raise ValueError("a choice must be a non-empty list of strings")
            return llguidance.grammar_from("choice", options)
        return llguidance.grammar_from("regex" if self.kind == "regex" else "grammar", self.spec)


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"expected {what} as JSON: {exc}") from None


@functools.lru_cache(maxsize=8)
def grammar_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of `tokenizer` (built once per tokenizer: it reads the whole vocabulary).

    An HF tokenizer folder gives its tokenizer.json; the byte tokenizer gives its byte table.
    """
    import llguidance

    eos = list(tokenizer.eos_token_ids) or None
    folder = getattr(tokenizer, "folder", None)
    if folder is not None and (Path(folder) / "tokenizer.json").exists():
        return llguidance.LLTokenizer(str(Path(folder) / "tokenizer.json"), n_vocab=vocab_size, eos_token=eos)
    if hasattr(tokenizer, "token_bytes"):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTable(tokenizer, vocab_size)), eos_token=eos)
    raise ValueError(f"constrained decoding needs a tokenizer.json; {type(tokenizer).__name__} has none")


class _ByteTable:
    """What llguidance's TokenizerWrapper reads from a tokenizer without a tokenizer.json."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokens = list(tokenizer.token_bytes())
        padding = range(len(self.tokens), vocab_size)  # ids without bytes: special, so no text can use them
        self.tokens += [f"<unused{i}>".encode() for i in padding]
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = [*tokenizer.special_ids, *padding]
        self._encode = tokenizer.encode

    def __call__(self, text) -> list[int]:
        return self._encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


class GrammarError(ValueError):
    """A request's grammar failed while its output was generated (the parser's limits: a schema too complex, or
    one with no finite instance); it ends that request alone, never its batch."""


def check(constraint: Constraint, tokenizer) -> str:
    """Why `constraint` cannot run with `tokenizer` (llguidance's message), or '' when it can."""
    import llguidance

    try:
        grammar = constraint.grammar()
    except ValueError as exc:
        return str(exc)
    message = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if message and not message.startswith("WARNING"):
        return one_line(message)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    token_mask(matcher, tokenizer.vocab_size)  # a grammar that admits no output (a $ref to itself) errs here
    return f"it admits no output (llguidance: {one_line(matcher.get_error())})" if matcher.is_error() else ""


# llguidance's advice that names its own options, none of which a request can set: what the client can do instead
ADVICE = {"oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate oneOf with anyOf":
          "a oneOf whose branches may overlap is not supported (only one may match): write anyOf where any may"}


def one_line(message: str) -> str:
    """llguidance's multi-line message (with a caret drawing) as one line: its first line and its `error:`."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    text = " ".join(lines[:1] + [line for line in lines[1:] if line.startswith("error:")])
    for theirs, ours in ADVICE.items():
        text = text.replace(theirs, ours)
    return text


def new_matcher(constraint: Constraint, tokenizer):
    """A fresh matcher at the start of the output; ValueError naming the grammar's error."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, constraint.grammar(), log_level=0)
    if matcher.is_error():
        raise ValueError(f"the grammar cannot run: {one_line(matcher.get_error())}")
    return matcher


def token_mask(matcher, vocab_size: int) -> np.ndarray:
    """The matcher's allowed tokens at its state, one bit per token: int32 [ceil(vocab / 32)] on the host."""
    bits = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    return bits


@functools.lru_cache(maxsize=8)
def _shifts(device: torch.device) -> torch.Tensor:
    torch = import_torch()
    return torch.arange(32, dtype=torch.int32, device=device)


def allowed_tokens(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """`token_mask`'s bits as one bool per token [vocab_size]."""
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab_size].view(bool)


def mask_logits(x: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    """Logits [vocab] with every token outside `bits` at -inf, on x's device (only the bits travel there)."""
    torch = import_torch()
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        # on the host numpy unpacks and selects about twice as fast as tensor ops
        allowed = allowed_tokens(bits, x.shape[-1])
        return torch.from_numpy(np.where(allowed, x.numpy(), np.array(-np.inf, dtype=x.numpy().dtype)))
    packed = torch.from_numpy(bits).to(x.device)
    allowed = ((packed[:, None] >> _shifts(x.device)) & 1).reshape(-1)[:x.shape[-1]].bool()
    return x.masked_fill(~allowed, float("-inf"))
