"""ONNX graphs written node by node, their weights streamed into one file that every graph of a bundle shares.

`WeightsFile` appends each weight once to `weights.bin`, 64-byte aligned, referred to as ONNX external data
(ONNX Runtime maps it: graphs sharing a weight read the same pages; no file passes ONNX's 2 GB limit).
`GraphBuilder` writes one graph. Neither knows what a transformer is.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

WEIGHTS_FILE = "weights.bin"
ALIGN = 64


class WeightsFile:
    """weights.bin, written as weights are added (`add` says where one lies), hashed as it is written."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / WEIGHTS_FILE
        self._file = _HashingWriter(open(self.path, "wb"))  # noqa: SIM115 -- closed by close()
        self._where: dict = {}  # key -> (offset, length)

    @property
    def sha256(self) -> str:
        return self._file.digest.hexdigest()

    def add(self, key, write) -> tuple[int, int]:
        """Where the weight `key` lies, writing it first (`write(file)` streams its bytes) unless it was added."""
        if key not in self._where:
            offset = self._file.tell()
            if offset % ALIGN:
                self._file.write(b"\0" * (ALIGN - offset % ALIGN))
                offset = self._file.tell()
            write(self._file)
            self._where[key] = (offset, self._file.tell() - offset)
        return self._where[key]

    def close(self) -> None:
        self._file.close()


class _HashingWriter:
    """A binary file that hashes (sha256) what is written to it."""

    def __init__(self, file):
        import hashlib

        self.file, self.digest = file, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def tell(self) -> int:
        return self.file.tell()

    def close(self) -> None:
        if not self.file.closed:
            self.file.flush()
            self.file.close()


class GraphBuilder:
    """One ONNX graph: nodes, inline constants, external weights; `save` writes it."""

    def __init__(self, name: str):
        self.name = name
        self.nodes, self.inputs, self.outputs, self.initializers = [], [], [], []
        self._count = 0
        self._external: set[str] = set()

    def fresh(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def op(self, op_type: str, inputs: list, outputs: int | list = 1, domain: str = "", **attrs):
        """Add a node; returns its output name (or names, when `outputs` is a count above 1 or a list)."""
        from onnx import helper

        names = outputs if isinstance(outputs, list) else [self.fresh(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, [i or "" for i in inputs], names, name=self.fresh(f"n{op_type}"),
                                           domain=domain, **attrs))
        return names[0] if len(names) == 1 else names

    def const(self, value, name: str | None = None) -> str:
        """An inline constant (small tensors: norms, biases, shapes)."""
        from onnx import numpy_helper

        name = name or self.fresh("c")
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def external(self, name: str, dtype, dims: tuple[int, ...], where: tuple[int, int]) -> str:
        """A weight that lies in weights.bin at `where` (offset, length)."""
        from onnx import TensorProto, helper

        if name in self._external:
            return name
        self._external.add(name)
        tensor = TensorProto()
        tensor.name, tensor.data_type = name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        tensor.dims.extend(dims)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", WEIGHTS_FILE), ("offset", str(where[0])), ("length", str(where[1]))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(tensor)
        return name

    def input(self, name: str, elem, shape: list) -> str:
        from onnx import helper

        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name: str, elem, shape: list) -> None:
        from onnx import helper

        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def save(self, path: Path, domains: dict[str, int], metadata: dict | None = None) -> None:
        import onnx
        from onnx import helper

        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(d, v) for d, v in domains.items()]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="mirror-rt")
        model.ir_version = 9
        if metadata:
            helper.set_model_props(model, metadata)
        onnx.save(model, str(path))  # the weights stay in weights.bin (external data): the graph is small
