"""OpenVINO export: a `SplitGraph` to a stateful IR (.xml + .bin) with compressed weights.

Per graph: `ov.convert_model`, stable tensor names, KV pairs folded into model state (the KV never crosses
to the host). Weights fp32, fp16 or int8 / int4 (`nncf.compress_weights`); openvino and nncf imported lazily.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from mirror_rt.exporters.split import (
    LAST_ROWS,
    GraphSpec,
    SplitGraph,
    example_inputs,
    input_names,
    output_names,
    state_pairs,
)

WEIGHTS = ("fp32", "fp16", "int8", "int4")


def _openvino():
    try:
        import openvino as ov
    except ImportError as exc:
        raise ImportError("OpenVINO export needs the 'openvino' package (pip install openvino nncf)") from exc
    return ov


def export_openvino_graph(model, spec: GraphSpec, table_len: int, weights: str, path: Path) -> list[Path]:
    """Write `path` (.xml) and its .bin for `spec` of `model`; returns both paths."""
    ov = _openvino()
    ov_model = convert_graph(model, spec, table_len)
    if weights in ("int8", "int4"):
        ov_model = compress_weights(ov_model, model.config, weights, table_len, symmetric=spec.static)
    ov.save_model(ov_model, str(path), compress_to_fp16=(weights == "fp16"))
    return [path, path.with_suffix(".bin")]


def convert_graph(model, spec: GraphSpec, table_len: int):
    """The ov.Model of `spec` (stateful unless it is the exit): inputs are input_ids|hidden (+ position when static)."""
    ov = _openvino()
    from openvino._offline_transformations import apply_make_stateful_transformation

    graph = SplitGraph(model, spec, table_len).eval()
    with torch.no_grad():
        ov_model = ov.convert_model(graph, example_input=example_inputs(model, spec))
    for port, name in zip(ov_model.inputs, input_names(spec)):
        port.get_tensor().set_names({name})
    for port, name in zip(ov_model.outputs, output_names(spec)):
        port.get_tensor().set_names({name})
    ov_model.reshape(_input_shapes(model.config, spec))
    if spec.has_kv:  # the exit graph is stateless
        apply_make_stateful_transformation(ov_model, state_pairs(spec))
    return ov_model


def _input_shapes(config, spec: GraphSpec) -> dict:
    ov = _openvino()
    T = spec.window if spec.static else -1
    S = spec.context if spec.static else -1
    first = ov.PartialShape([T] if spec.takes_tokens else [T, config.hidden_size])
    shapes = {input_names(spec)[0]: first}
    if spec.static and spec.has_kv:
        shapes["position"] = ov.PartialShape([1])
    if spec.takes_last_rows:
        shapes[LAST_ROWS] = ov.PartialShape([1])
    kv = ov.PartialShape([1, config.n_kv_heads, S, config.head_dim])
    return shapes | dict.fromkeys(state_pairs(spec), kv)


def compress_weights(ov_model, config, weights: str, table_len: int, symmetric: bool = False):
    """int8 or int4 weight-only compression; the RoPE tables stay in full precision.

    int4 is always symmetric (the NPU's requirement; CPU and GPU run it too), with the
    largest group size in 128, 64, 32, 16 dividing every projection's input width: nncf's
    default 128 fails on hidden size 576 (SmolLM2). `symmetric` picks INT8_SYM (static/NPU).
    """
    import nncf

    ignored = nncf.IgnoredScope(names=_rope_gathers(ov_model, table_len, config.head_dim), validate=False)
    if weights == "int8":
        mode = nncf.CompressWeightsMode.INT8_SYM if symmetric else nncf.CompressWeightsMode.INT8_ASYM
        return nncf.compress_weights(ov_model, mode=mode, ignored_scope=ignored)
    return nncf.compress_weights(ov_model, mode=nncf.CompressWeightsMode.INT4_SYM, ratio=1.0,
                                 group_size=int4_group_size(config), ignored_scope=ignored)


def int4_group_size(config) -> int:
    """Largest of 128, 64, 32, 16 dividing every matmul input width, else -1 (per channel)."""
    widths = (config.hidden_size, config.intermediate_size, config.n_heads * config.head_dim)
    for size in (128, 64, 32, 16):
        if all(w % size == 0 for w in widths):
            return size
    return -1


def _rope_gathers(ov_model, table_len: int, head_dim: int) -> list[str]:
    """Names of the Gathers reading the RoPE tables (nncf would take them for embeddings)."""
    names = []
    for op in ov_model.get_ops():
        if op.get_type_name() != "Gather":
            continue
        source = op.input_value(0).get_node()
        if source.get_type_name() == "Constant" and list(source.get_output_shape(0)) == [table_len, head_dim]:
            names.append(op.get_friendly_name())
    return names


def export_openvino_tokenizer(folder: Path, out_dir: Path) -> list[Path]:
    """openvino_tokenizer.xml / openvino_detokenizer.xml from a HF tokenizer folder.

    Best effort: a tokenizer that openvino_tokenizers cannot convert only warns, since the
    runtime tokenizes with the Hugging Face files that travel with the bundle anyway.
    """
    ov = _openvino()
    try:
        from openvino_tokenizers import convert_tokenizer
        from transformers import AutoTokenizer

        tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(folder), with_detokenizer=True)
        paths = [out_dir / "openvino_tokenizer.xml", out_dir / "openvino_detokenizer.xml"]
        for ov_model, path in zip((tok, detok), paths):
            ov.save_model(ov_model, str(path))
    except Exception as exc:  # noqa: BLE001 -- any converter failure: the bundle stays usable without it
        warnings.warn(f"openvino tokenizer not exported ({type(exc).__name__}: {str(exc)[:120]})",
                      stacklevel=2)
        return []
    return [p for path in paths for p in (path, path.with_suffix(".bin")) if p.exists()]
