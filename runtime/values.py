"""What callers hand the runtime, checked: the type checks the settings' validations share (JSON's true and Python's
True are ints to isinstance, and a setting given as a bool, a string or None must be refused by name, not fail later
inside a comparison), a library's error as the one line a refusal quotes, and what the Python API takes as a prompt
(text, token ids or chat messages; anything else gets a one-line reason before the tokenizer sees it)."""

from __future__ import annotations

import numbers


def is_integer(value) -> bool:
    """An integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number (integers included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def error_line(exc: BaseException) -> str:
    """The first line of `exc`'s message, or its type's name when it has none (a library's multi-line error quoted
    in a one-line refusal)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def prompt_problem(prompt) -> str | None:
    """Why `prompt` cannot be tokenized (None when it can)."""
    if isinstance(prompt, str):
        return text_problem(prompt, "prompt")
    if not isinstance(prompt, (list, tuple)):
        return f"a prompt is text, a list of token ids or a list of chat messages, not {type(prompt).__name__}"
    if not prompt:
        return "empty prompt"
    if all(is_integer(t) for t in prompt):
        return None
    if all(isinstance(m, dict) for m in prompt):
        return next((p for p in (message_problem(i, m) for i, m in enumerate(prompt)) if p), None)
    return "a prompt list holds token ids (integers) or chat messages (dicts), not a mix or other values"


def message_problem(index: int, message: dict) -> str | None:
    """Why chat message `index` cannot be rendered (None when it can)."""
    role = message.get("role")
    if not isinstance(role, str):
        return f"message {index} needs a string 'role'"
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        return None
    if not isinstance(content, str):
        shown = "no 'content'" if content is None else f"a 'content' of type {type(content).__name__}"
        return f"message {index} ({role}) has {shown}; content must be a string"
    return text_problem(content, f"message {index} content")


def text_problem(text: str, what: str) -> str | None:
    """Text that cannot be encoded as UTF-8 (a lone surrogate) has no tokens."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{what} is not valid Unicode text (a lone surrogate at index {exc.start})"
    return None
