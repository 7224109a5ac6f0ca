"""ONNX export: a `SplitGraph` to a .onnx file with explicit KV inputs and outputs.

TorchScript export (dynamic window and past lengths, explicit KV). Weights: fp32; int8 / int4 through
MatMulNBits (activations quantized per row and block of 32: a row's output never depends on the other rows);
q4_1 (exporters.q4_min); w8a8 (exporters.w8a8).
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch

from mirror_rt.exporters.native_op import ATTENTION
from mirror_rt.exporters.native_op import DOMAIN as NATIVE_DOMAIN
from mirror_rt.exporters.q4_min import pad_4bit_rows, quantize_q4_min
from mirror_rt.exporters.shared_kv import DOMAIN, TOTAL_LEN
from mirror_rt.exporters.split import (
    GraphSpec,
    SplitGraph,
    example_inputs,
    input_names,
    output_names,
)

WEIGHTS = ("fp32", "int8", "int4", "q4_1", "w8a8")
OPSET = 17
# Weights -> (bits of the projections, bits of the LM head). The head of a small model is a
# large share of its weights and the most sensitive to rounding: int4 graphs keep it at 8 bits.
NBITS = {"int8": (8, 8), "int4": (4, 8)}
BLOCK_SIZE = 32  # weights per scale along K; divides 576 and 1536 (SmolLM2), 64 and 128 (tiny)
# MatMulNBits accuracy_level 4: int8 activations (per row and block) with int8 dot products
# (VNNI / SDOT). Unset, 8-bit weights run a naive dequantize-then-fp32 path (~15x slower).
ACCURACY_LEVEL = 4


def export_onnx_graph(model, spec: GraphSpec, table_len: int, weights: str, path: Path) -> list[Path]:
    """Write `path` (.onnx) for `spec` of `model`; returns the files written."""
    if spec.static:
        raise ValueError("static ONNX graphs are not supported; use --format openvino for --static")
    if weights not in WEIGHTS:
        raise ValueError(f"--format onnx supports weights {', '.join(WEIGHTS)}, not '{weights}'")
    graph = SplitGraph(model, spec, table_len).eval()
    raw = path if weights == "fp32" else path.with_suffix(".fp32.onnx")
    ins, outs = input_names(spec), output_names(spec)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-to-int conversions
        torch.onnx.export(graph, example_inputs(model, spec), str(raw), input_names=ins, output_names=outs,
                          dynamic_axes=_dynamic_axes(spec, ins, outs), opset_version=OPSET, dynamo=False,
                          do_constant_folding=True, custom_opsets=_opsets(spec))
    if weights != "fp32":
        quantize_weights(raw, path, weights, getattr(model, "head_size", model.config.vocab_size),  # pruned head
                         native=spec.pool, row_invariant=spec.role != "draft")
        raw.unlink()
    if spec.pool:
        _mark(path, {ATTENTION: "pool"})
    return [path]


def _mark(path: Path, props: dict) -> None:
    """Model metadata the backend reads (ATTENTION: the graph's rows attend apart, whatever their lengths)."""
    import onnx

    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, props)
    onnx.save(model, str(path))


def _opsets(spec: GraphSpec) -> dict | None:
    """The custom domains a graph uses: com.microsoft's ops in shared-KV graphs, mirror-rt's op in pool graphs."""
    if not spec.shared_kv:
        return None
    return {DOMAIN: 1, **({NATIVE_DOMAIN: 1} if spec.pool else {})}


def _dynamic_axes(spec: GraphSpec, ins: list[str], outs: list[str]) -> dict:
    if spec.shared_kv:  # batched: rows of sequences over one buffer per layer
        return _shared_axes(spec, ins, outs)
    axes = {ins[0]: {0: "window"}}
    for name in ins[1:]:
        if name.startswith("past_"):
            axes[name] = {2: "past"}
    for name in outs:  # logits rows follow last_rows where the graph takes it
        axes[name] = {2: "total"} if name.startswith("present") else {0: "rows" if spec.takes_last_rows else "window"}
    return axes


def _shared_axes(spec: GraphSpec, ins: list[str], outs: list[str]) -> dict:
    """Batched shared-KV graphs: [batch, window(, hidden)] in, buffers [batch, KVH, capacity, D], total_len [batch]."""
    axes = {ins[0]: {0: "batch", 1: "window"}}
    for name in ins[1:]:
        if name.startswith("past_"):
            axes[name] = {0: "batch", 2: "capacity"}
        elif name == TOTAL_LEN:
            axes[name] = {0: "batch"}
    for name in outs:
        if name.startswith("present"):
            axes[name] = {0: "batch", 2: "capacity"}
        else:
            axes[name] = {0: "batch", 1: "rows" if name == "logits" and spec.takes_last_rows else "window"}
    return axes


def quantize_weights(src: Path, dst: Path, weights: str, vocab_size: int, keep: tuple[str, ...] = (),
                     native: bool = False, row_invariant: bool = False) -> None:
    """Quantization of `src` into `dst`: MatMulNBits "int8" or "int4" (see NBITS), "q4_1" (exporters.q4_min),
    "w8a8" (exporters.w8a8; `native`: its activations quantized by mirror-rt's op; `row_invariant`: 4-bit
    products (q4_1, int4) never run one row, see exporters.q4_min). MatMuls named in `keep` stay fp32.

    The LM head (a MatMul whose weight has `vocab_size` columns; the tied embedding's
    transposed copy) gets the head's bits; the embedding Gather stays fp32 (a lookup costs
    nothing per token). MatMuls of two activations (attention) are left as they are.
    """
    import onnx

    model = onnx.load(str(src))
    heads = _head_nodes(model.graph, vocab_size)
    keep = list(keep)
    if weights == "w8a8":  # every product, heads included (one row's scale serves a whole product)
        from mirror_rt.exporters.w8a8 import quantize_w8a8

        model = quantize_w8a8(model, keep, native)
    elif weights == "q4_1":  # heads int8 first, then every other product in 4 bits with a minimum
        others = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in heads]
        model = quantize_q4_min(_quantize_matmuls(model, 8, exclude=others + keep), keep, ACCURACY_LEVEL,
                                row_invariant)
    else:
        bits, head_bits = NBITS[weights]
        model = _quantize_matmuls(model, bits, exclude=(heads if head_bits != bits else []) + keep)
        if head_bits != bits:
            model = _quantize_matmuls(model, head_bits, exclude=keep)  # only the heads (and `keep`) are still MatMuls
        if row_invariant and bits == 4:
            model = pad_4bit_rows(model)
    onnx.save(model, str(dst))


def _head_nodes(graph, vocab_size: int) -> list[str]:
    """Names of the MatMuls whose constant weight is [hidden, vocab] (final and early-exit heads)."""
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    return [n.name for n in graph.node if n.op_type == "MatMul" and len(shapes.get(n.input[1], ())) == 2
            and shapes[n.input[1]][1] == vocab_size]


def _quantize_matmuls(model, bits: int, exclude: list[str]):
    """Every constant-weight MatMul not in `exclude` -> MatMulNBits of `bits`; returns the model."""
    quantizer = _nbits_quantizer()(model, bits=bits, block_size=BLOCK_SIZE, is_symmetric=True,
                                   accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=exclude,
                                   op_types_to_quantize=("MatMul",))
    quantizer.process()
    return quantizer.model.model


def _nbits_quantizer():
    """onnxruntime's MatMulNBitsQuantizer, imported without its logging side effects.

    Importing it calls `logging.basicConfig(level=INFO)` and it logs every node it skips:
    the root logger is restored and the module's logger raised to WARNING.
    """
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as exc:
        raise ImportError("int8/int4 ONNX export needs 'onnxruntime' and 'onnx_ir' "
                          "(pip install onnxruntime onnx_ir)") from exc
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers
    logging.getLogger(MatMulNBitsQuantizer.__module__).setLevel(logging.WARNING)
    return MatMulNBitsQuantizer
