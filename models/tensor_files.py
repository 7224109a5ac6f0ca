"""Tensor files: safetensors written with the permissions any other file gets here, and weights read where they lie.

safetensors writes its files 0600, so a bundle, an exit adapter or trained streams copied for another account (or
served by one) could not be read there, while the JSON beside them could (0644 under the usual umask).
`TensorInfo` says where one weight's bytes are in a file (a GGUF's blocks, a safetensors array), so a reader can
take one tensor at a time from a memory map instead of loading a checkpoint whole.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def save_tensors(tensors: dict, path) -> None:
    """`tensors` (name -> torch tensor) to `path` as safetensors, readable as the umask allows."""
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    umask = os.umask(0)
    os.umask(umask)
    Path(path).chmod(0o666 & ~umask)


# GGML type ids of the float types (gguf.GGMLQuantizationType), for safetensors' dtypes too.
F32, F16, BF16 = 0, 1, 30
SAFETENSORS_TYPES = {"F32": F32, "F16": F16, "BF16": BF16}


@dataclass(frozen=True)
class TensorInfo:
    """One weight where it lies in a file: GGML type id, rows (the output axis), values per row, its bytes."""

    name: str  # as the checkpoint names it (embed, layers.3.q, ...: models.weights)
    type: int  # GGML type id (gguf.GGMLQuantizationType; F32, F16, BF16 for safetensors)
    rows: int  # outer dimension (1 for vectors)
    columns: int  # values per row (the reduction axis of a product)
    file: Path
    offset: int  # file offset of the first byte
    nbytes: int


def safetensors_table(path: Path) -> dict[str, dict]:
    """A safetensors file's header: tensor name -> {dtype, shape, offset (absolute), nbytes}; ValueError naming the
    file for one that is cut short or not safetensors."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            length = struct.unpack("<Q", f.read(8))[0]
            if length > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise ValueError(f"cannot read {path} (cut short, or not safetensors?): {exc}") from None
    table = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        if 8 + length + end > size:
            raise ValueError(f"{path} is cut short: {name} ends at byte {8 + length + end}, the file has {size}")
        table[name] = {"dtype": entry["dtype"], "shape": entry["shape"], "offset": 8 + length + start,
                       "nbytes": end - start}
    return table


def float_array(info: TensorInfo) -> np.ndarray:
    """A float tensor (F32, F16, BF16) from its file as float32 [rows, columns] (vectors [columns])."""
    raw = np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
    if info.type == F32:
        values = np.array(raw.view(np.float32))
    elif info.type == F16:
        values = raw.view(np.float16).astype(np.float32)
    elif info.type == BF16:
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        raise ValueError(f"{info.name} is not a float tensor (GGML type {info.type})")
    return values.reshape(info.rows, info.columns) if info.rows > 1 else values.reshape(info.columns)
