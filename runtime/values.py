"""Type checks the settings' validations share: JSON's true and Python's True are ints to isinstance, and a setting
given as a bool, a string or None must be refused by name, not fail later inside a comparison; and a library's
error as the one line a refusal quotes."""

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
