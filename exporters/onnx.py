"""ONNX export: a `SplitGraph` to a .onnx file with explicit KV inputs and outputs.

The TorchScript exporter (`torch.onnx.export(dynamo=False)`) is used: it needs no
onnxscript and handles dynamic axes for the window length and the past length. KV stays
explicit (ONNX has no state), so ONNX Runtime passes the cache in and out each call; the
OpenVINO backend can still load the .onnx and make it stateful at load time.
Weights: fp32, or int8 through onnxruntime's dynamic quantization (MatMulInteger). The
latter quantizes activations with one scale per call, so a graph's output depends on the
other rows of its window: fine for a draft, not batch-invariant enough for a target.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from mirror_rt.exporters.split import (
    GraphSpec,
    SplitGraph,
    example_inputs,
    input_names,
    output_names,
)

WEIGHTS = ("fp32", "int8")
OPSET = 17


def export_onnx_graph(model, spec: GraphSpec, table_len: int, weights: str, path: Path) -> list[Path]:
    """Write `path` (.onnx) for `spec` of `model`; returns the files written."""
    if spec.static:
        raise ValueError("static ONNX graphs are not supported; use --format openvino for --static")
    if weights not in WEIGHTS:
        raise ValueError(f"--format onnx supports weights {', '.join(WEIGHTS)}, not '{weights}'")
    graph = SplitGraph(model, spec, table_len).eval()
    raw = path.with_suffix(".fp32.onnx") if weights == "int8" else path
    ins, outs = input_names(spec), output_names(spec)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-to-int conversions
        torch.onnx.export(graph, example_inputs(model, spec), str(raw), input_names=ins, output_names=outs,
                          dynamic_axes=_dynamic_axes(spec, ins, outs), opset_version=OPSET, dynamo=False,
                          do_constant_folding=True)
    if weights == "int8":
        _quantize_int8(raw, path)
        raw.unlink()
    return [path]


def _dynamic_axes(spec: GraphSpec, ins: list[str], outs: list[str]) -> dict:
    axes = {ins[0]: {0: "window"}}
    for name in ins[1:]:
        axes[name] = {2: "past"}
    for name in outs:
        axes[name] = {2: "total"} if name.startswith("present") else {0: "window"}
    return axes


def _quantize_int8(src: Path, dst: Path) -> None:
    """Dynamic int8 quantization of the MatMul weights (activations quantized per call)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
