"""Argument types and the log line shared by the `mirror-rt` subcommands."""

from __future__ import annotations

import argparse
import os
import sys


def whole(text: str, minimum: int, expected: str = "a whole number") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got '{text}'") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole(text, 1)


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None


def positive_number(text: str) -> float:
    value = number(text)
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got '{text}'")
    return value


def port_number(text: str) -> int:
    value = whole(text, 1, "a port number")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1..65535), got {value}")
    return value


def count(text: str) -> int:
    return whole(text, 0)


def budget(text: str) -> int | None:
    return None if text == "auto" else whole(text, 0, "'auto' or a whole number")


def output_folder(text: str) -> str:
    """A folder to write into: refused at once (not after the work) when a file holds the name or the place
    refuses writing."""
    return _writable(text, folder=True)


def output_file(text: str) -> str:
    """A file to write: refused at once (not after the work) when it is a folder or its place refuses writing."""
    return _writable(text, folder=False)


def _writable(text: str, folder: bool) -> str:
    from mirror_rt.exporters.paths import OutputPathError, check_writable

    if os.path.exists(text) and folder and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    try:
        check_writable(text, folder=folder)
    except OutputPathError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
