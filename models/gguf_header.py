"""A GGUF file's header read in well under a second: its architecture and whether the file holds every tensor.

gguf-py's reader builds an array per metadata item (40-50 s for a 7B's tokenizer on a busy CPU), so a file mirror-rt
cannot run was refused only after that, behind an export's progress bar. This scan steps over the header with
`struct` (tokenizer arrays skipped by their lengths), then `check_gguf` refuses an architecture mirror-rt does not
run and a file cut short (saying how many bytes its tensors need and how many it has) before anything is exported.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from mirror_rt.models.config import SUPPORTED_ARCHITECTURES

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types: struct format of the fixed-size ones (8: string, 9: array)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file mirror-rt cannot run (one line naming the file)."""


class _CutShort(Exception):
    """The header itself runs past the end of the file."""


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF header says: its scalar and string metadata, and the bytes its tensors need."""

    version: int
    metadata: dict  # scalars and strings; arrays are skipped (None)
    tensors: int
    data_start: int  # where the tensors' data begin (aligned)
    data_end: int  # where the last tensor's data end: the size the whole file must have at least
    size: int  # the file's size

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))


def read_header(path: str | Path) -> GGUFHeader:
    """The header of the GGUF file at `path` (GGUFError when it is none, or is cut short within its header)."""
    path = Path(path)
    return _read_header(str(path.resolve()), *_identity(path))


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _read_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    if size < 24:
        raise GGUFError(f"{path} is not a GGUF model: {size} bytes, fewer than a GGUF header's first 24")
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        if view[:4] != MAGIC:
            raise GGUFError(f"{path} is not a GGUF model (it does not start with 'GGUF')")
        try:
            return _Scan(view, size).header()
        except _CutShort as exc:
            raise GGUFError(f"{path} is cut short within its header: it ends at byte {size}, the header needs "
                            f"{exc.args[0]} bytes at least (an interrupted download or copy?)") from None


class _Scan:
    """A cursor over the mapped header."""

    def __init__(self, view, size: int):
        self.view, self.size, self.at = view, size, 4

    def take(self, fmt: str):
        end = self.at + struct.calcsize(fmt)
        if end > self.size:
            raise _CutShort(end)
        value = struct.unpack_from(fmt, self.view, self.at)[0]
        self.at = end
        return value

    def string(self, keep: bool = True) -> str | None:
        length = self.take("<Q")
        end = self.at + length
        if end > self.size:
            raise _CutShort(end)
        text = bytes(self.view[self.at:end]).decode("utf-8", errors="replace") if keep else None
        self.at = end
        return text

    def value(self, kind: int):
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise GGUFError(f"unknown GGUF value type {kind} at byte {self.at}")
        item, count = self.take("<I"), self.take("<Q")
        if item in SCALARS:
            self.at += count * struct.calcsize(SCALARS[item])
            if self.at > self.size:
                raise _CutShort(self.at)
        else:
            for _ in range(count):
                self.value(item) if item != STRING else self.string(keep=False)
        return None

    def header(self) -> GGUFHeader:
        from gguf.constants import GGML_QUANT_SIZES

        version, tensors, items = self.take("<I"), self.take("<Q"), self.take("<Q")
        metadata = {}
        for _ in range(items):
            key = self.string()
            metadata[key] = self.value(self.take("<I"))
        ends = []
        for _ in range(tensors):
            self.string(keep=False)
            dims = [self.take("<Q") for _ in range(self.take("<I"))]
            kind, offset = self.take("<I"), self.take("<Q")
            block, block_bytes = GGML_QUANT_SIZES.get(kind, (1, 0))
            elements = 1
            for d in dims:
                elements *= d
            ends.append(offset + elements // block * block_bytes)
        align = int(metadata.get("general.alignment") or DEFAULT_ALIGNMENT)
        start = -(-self.at // align) * align
        return GGUFHeader(version, metadata, tensors, start, start + max(ends, default=0), self.size)


def check_gguf(path: str | Path) -> GGUFHeader:
    """The header of a GGUF file mirror-rt can run; GGUFError, in one line, for an architecture it does not run
    or a file shorter than its tensors (both known from the header alone)."""
    header = read_header(path)
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported architecture '{arch}': mirror-rt runs Llama-family models "
                        f"({', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    if header.data_end > header.size:
        missing = header.data_end - header.size
        raise GGUFError(f"{path} is cut short: its {header.tensors} tensors need {header.data_end} bytes, the file "
                        f"has {header.size} ({missing} missing: an interrupted download or copy?)")
    return header
