"""`w8a8`: int8 weights per output column and int8 activations per row, multiplied in int32.

Every constant-weight MatMul: one int8 scale per weight column and, at run time, one per activation row
(uint8, zero point 128; ONNX Runtime's u8s8 integer GEMM). A row's output depends on that row alone, so a batch and
a one-token step compute it alike. A graph pass over ONNX; it knows no model.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import numpy as np

from mirror_rt.exporters.native_op import DOMAIN, QUANTIZE_ROWS
from mirror_rt.exporters.q4_min import replace_nodes

LEVELS = 127  # activations, symmetric int8: -127..127 (no -128, so negation is exact)
# Weights take 7 bits: ONNX Runtime's u8s8 GEMM on AVX2 without VNNI (vpmaddubsw) adds two u8 x s8 products in int16
# and saturates past 32767; 255 * 63 * 2 = 32130 never does (255 * 127 * 2 did: 3% of outputs off by up to 6x here)
WEIGHT_LEVELS = 63
ZERO_POINT = 128  # activations as uint8: q + 128
TINY = 1e-30  # an all-zero row gets this scale instead of 0 (no 0/0)


def quantize_w8a8(model, exclude: list[str], native: bool = False):
    """Every constant-weight 2-D MatMul of `model` (onnx ModelProto) not in `exclude` -> the w8a8 form; in place.
    `native`: each input's rows quantized by mirror-rt's op (`mirror_rt::QuantizeRows`, exporters.native_op: the
    same bits in one node where the standard ops take six)."""

    if _opset(model) < 13:  # QuantizeLinear with a scalar scale and uint8 zero point, as used here
        raise ValueError(f"w8a8 needs an ONNX opset >= 13, the graph has {_opset(model)}")
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    constants = _constants(graph, axes_input=_opset(model) >= 18, rows=not native)
    nodes, quantized, used = [], {}, set()
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is None or node.name in exclude or len(weight.dims) != 2:
            nodes.append(node)
            continue
        used.add(weight.name)
        x = node.input[0]
        if x not in quantized:
            quantized[x] = (_quantize_rows_native if native else _quantize_rows)(nodes, x, constants)
        nodes += _integer_product(graph, node, weight, quantized[x], constants)
    if native and not any(o.domain == DOMAIN for o in model.opset_import):
        from onnx import helper

        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return replace_nodes(model, nodes, used)


def weight_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] float -> (q [K, N] int8 in -63..63, scales [N] float32) with w ~ q * scales."""
    top = np.abs(w.astype(np.float64)).max(axis=0)
    scales = np.where(top > 0, top / WEIGHT_LEVELS, 1.0)
    q = np.clip(np.rint(w / scales), -WEIGHT_LEVELS, WEIGHT_LEVELS).astype(np.int8)
    return q, scales.astype(np.float32)


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _constants(graph, axes_input: bool, rows: bool = True) -> dict:
    """Scalar constants every quantized input uses, added once: the products' scale and zero point, and with
    `rows` those of the standard ops that quantize the rows (ReduceMax's axes: an input from opset 18)."""
    from onnx import numpy_helper

    values = {"one": np.array(1.0, np.float32), "zero_point": np.array(ZERO_POINT, np.uint8)}
    if rows:
        values |= {"inv_levels": np.array(1 / LEVELS, np.float32), "tiny": np.array(TINY, np.float32)}
    if rows and axes_input:
        values["axes"] = np.array([-1], np.int64)
    graph.initializer.extend(numpy_helper.from_array(v, f"w8a8.{k}") for k, v in values.items())
    return {k: f"w8a8.{k}" for k in values}


def _quantize_rows(nodes: list, x: str, c: dict) -> tuple[str, str]:
    """Append the nodes that quantize x [..., K] per row; returns (uint8 x, row scales [..., 1])."""
    from onnx import helper

    n = {k: f"{x}.w8a8_{k}" for k in ("abs", "max", "raw_scale", "scale", "scaled", "q")}
    reduce = (helper.make_node("ReduceMax", [n["abs"], c["axes"]], [n["max"]], name=n["max"], keepdims=1)
              if "axes" in c else helper.make_node("ReduceMax", [n["abs"]], [n["max"]], name=n["max"], keepdims=1,
                                                   axes=[-1]))
    nodes += [helper.make_node("Abs", [x], [n["abs"]], name=n["abs"]), reduce,
              helper.make_node("Mul", [n["max"], c["inv_levels"]], [n["raw_scale"]], name=n["raw_scale"]),
              helper.make_node("Max", [n["raw_scale"], c["tiny"]], [n["scale"]], name=n["scale"]),
              helper.make_node("Div", [x, n["scale"]], [n["scaled"]], name=n["scaled"]),
              helper.make_node("QuantizeLinear", [n["scaled"], c["one"], c["zero_point"]], [n["q"]], name=n["q"])]
    return n["q"], n["scale"]


def _quantize_rows_native(nodes: list, x: str, c: dict) -> tuple[str, str]:
    """As _quantize_rows, in one node of mirror-rt's op."""
    from onnx import helper

    q, scale = f"{x}.w8a8_q", f"{x}.w8a8_scale"
    nodes.append(helper.make_node(QUANTIZE_ROWS, [x], [q, scale], name=q, domain=DOMAIN))
    return q, scale


def _integer_product(graph, node, weight, quantized: tuple[str, str], c: dict) -> list:
    """The nodes replacing MatMul `node`: the integer product of the quantized rows and weights, scaled back."""
    from onnx import helper, numpy_helper

    q, scales = weight_columns(numpy_helper.to_array(weight))
    name = node.name or node.output[0]
    w, w_scales, columns = f"{name}.w8", f"{name}.w8_scales", f"{name}.columns"
    graph.initializer.extend([numpy_helper.from_array(q, w), numpy_helper.from_array(scales, w_scales)])
    x_q, x_scale = quantized
    return [helper.make_node("MatMulIntegerToFloat", [x_q, w, c["one"], w_scales, c["zero_point"]], [columns],
                             name=f"{name}.w8a8", domain="com.microsoft"),
            helper.make_node("Mul", [columns, x_scale], [node.output[0]], name=f"{name}.rows")]
