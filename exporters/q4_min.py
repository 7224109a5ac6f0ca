"""4-bit weights with a scale and a minimum per block of 32 (llama.cpp's Q4_1 layout) on ONNX Runtime.

w = d * q + m (q in 0..15): MatMulNBits takes only integer zero points, so the graph computes
MatMulNBits(x; q, d, zero point 8) + blocksum(x) @ (m + 8 d), each row's block sums its own. Q4_1 weights to begin
with (the default model's GGUF) are recovered bit for bit; only the int8 activations differ from fp32.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
LEVELS = 15  # q in 0..LEVELS


def quantize_q4_min(model, exclude: list[str], accuracy_level: int, row_invariant: bool = False):
    """Every constant-weight MatMul of `model` (onnx ModelProto) not in `exclude` -> Q4_1 form; in place.

    `row_invariant` (targets): every product reads its input as rows [M, K] with one zero row appended, so that
    MLAS never takes its one-row 4-bit kernel, whose sums differ in the last bits from its many-row kernel on
    CPUs without VNNI (AVX2); a row then computes alike in any call shape. Drafts skip it (one row is faster).
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    nodes, blocksums, padded, used = [], {}, {}, set()
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is None or node.name in exclude or len(weight.dims) != 2 or weight.dims[0] % BLOCK:
            nodes.append(node)
            continue
        packed, scales, correction = q4_min_blocks(numpy_helper.to_array(weight))
        k, n = weight.dims
        name = node.name or node.output[0]
        x, y = node.input[0], node.output[0]
        if row_invariant:
            if x not in padded:
                padded[x] = _padded_rows(graph, nodes, x, k)
            x, y = padded[x][0], f"{name}.padded"
        used.add(weight.name)
        graph.initializer.extend([numpy_helper.from_array(packed, f"{name}.q4"),
                                  numpy_helper.from_array(scales, f"{name}.scales"),
                                  numpy_helper.from_array(correction, f"{name}.min")])
        if x not in blocksums:
            blocksums[x] = _blocksum_nodes(graph, nodes, x, k)
        nodes += [helper.make_node("MatMulNBits", [x, f"{name}.q4", f"{name}.scales"], [f"{name}.main"],
                                   name=f"{name}.nbits", domain="com.microsoft", K=k, N=n, bits=4,
                                   block_size=BLOCK, accuracy_level=accuracy_level),
                  helper.make_node("MatMul", [blocksums[x], f"{name}.min"], [f"{name}.shift"], name=f"{name}.shift"),
                  helper.make_node("Add", [f"{name}.main", f"{name}.shift"], [y], name=f"{name}.add")]
        if row_invariant:
            nodes += _unpadded_rows(graph, y, padded[node.input[0]][1], n, node.output[0], name)
    return replace_nodes(model, nodes, used)


def pad_4bit_rows(model):
    """Every 4-bit MatMulNBits of `model` (int4 targets) reads its rows with a zero row appended, as
    `quantize_q4_min(row_invariant=True)` does: never MLAS's one-row 4-bit kernel. In place; returns the model."""
    from onnx import helper

    graph = model.graph
    nodes, padded = [], {}
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "MatMulNBits" or attrs.get("bits") != 4:
            nodes.append(node)
            continue
        x, y = node.input[0], node.output[0]
        if x not in padded:
            padded[x] = _padded_rows(graph, nodes, x, attrs["K"])
        node.input[0], node.output[0] = padded[x][0], f"{node.name}.padded"
        nodes += [node, *_unpadded_rows(graph, node.output[0], padded[x][1], attrs["N"], y, node.name)]
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def as_gguf_q4_1(model) -> int:
    """Each 4-bit product with a minimum that `quantize_q4_min` wrote (MatMulNBits `<name>.nbits`, the block sums'
    product `<name>.shift`, their sum `<name>.add`) as one mirror-rt MatMulGGUF over the same weights as GGUF Q4_1
    blocks (halves d and m = correction - 8 d, then the levels 0..15 in llama.cpp's order), the block sums' nodes
    dropped once nothing reads them; in place, returns how many. MatMulGGUF quantizes the activations per block of
    32 as MatMulNBits' accuracy level 4 does; d and m round to halves (exact where the weights were Q4_1 blocks)."""
    from onnx import helper, numpy_helper

    from mirror_rt.exporters.native_op import DOMAIN

    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    by_name = {node.name: node for node in graph.node}
    nodes, dropped, blocks = [], set(), []
    for node in graph.node:
        name = node.name[:-len(".nbits")]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "MatMulNBits" or not node.name.endswith(".nbits") or attrs.get("bits") != 4
                or f"{name}.add" not in by_name or f"{name}.min" not in weights):
            nodes.append(node)
            continue
        k, n = attrs["K"], attrs["N"]
        packed = numpy_helper.to_array(weights[f"{name}.q4"]).reshape(n, k // BLOCK, BLOCK // 2)
        d = numpy_helper.to_array(weights[f"{name}.scales"]).reshape(n, k // BLOCK)
        minimum = numpy_helper.to_array(weights[f"{name}.min"]).T - 8 * d  # correction = m + 8 d
        blocks.append(numpy_helper.from_array(q4_1_blocks(packed, d, minimum), f"{name}.q4_1"))
        nodes.append(helper.make_node("MatMulGGUF", [node.input[0], f"{name}.q4_1"], [by_name[f"{name}.add"].output[0]],
                                      name=f"{name}.gguf", domain=DOMAIN, type=Q4_1_TYPE, k=k))
        dropped |= {node.name, f"{name}.shift", f"{name}.add"}
    if not blocks:
        return 0
    from mirror_rt.exporters.native_rewrites import replace_graph

    replace_graph(model, [node for node in nodes if node.name not in dropped], blocks)  # the block sums' nodes go
    return len(blocks)


Q4_1_TYPE = 3  # GGML's type number of Q4_1 blocks (MatMulGGUF's `type`)


def q4_1_blocks(packed: np.ndarray, d: np.ndarray, minimum: np.ndarray) -> np.ndarray:
    """MatMulNBits' 4-bit rows (packed [N, K/32, 16]: byte j holds levels 2j, 2j + 1 low nibble first) with their
    scales d and minimums [N, K/32] as GGUF Q4_1 rows [N, K/32 * 20]: d, m as halves, byte i the levels i and 16 + i."""
    n, blocks, _ = packed.shape
    levels = np.empty((n, blocks, BLOCK), dtype=np.uint8)
    levels[..., 0::2], levels[..., 1::2] = packed & 15, packed >> 4
    out = np.empty((n, blocks, 20), dtype=np.uint8)
    out[..., 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, blocks, 2)
    out[..., 2:4] = minimum.astype(np.float16).view(np.uint8).reshape(n, blocks, 2)
    out[..., 4:] = levels[..., :16] | (levels[..., 16:] << 4)
    return out.reshape(n, blocks * 20)


def replace_nodes(model, nodes: list, used: set):
    """`model` with its graph's nodes replaced by `nodes`, the initializers named in `used` dropped (their
    quantized forms replace them) and the com.microsoft opset declared."""
    from onnx import helper

    graph = model.graph
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [t for t in graph.initializer if t.name not in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def q4_min_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [K, N] -> (packed q [N, K/32, 16] uint8, scales d [N * K/32] float32, C [K/32, N] float32)."""
    k, n = w.shape
    blocks = w.astype(np.float64).reshape(k // BLOCK, BLOCK, n)
    low, high = blocks.min(axis=1), blocks.max(axis=1)  # [K/32, N]
    d = (high - low) / LEVELS
    safe = np.where(d > 0, d, 1.0)
    q = np.clip(np.rint((blocks - low[:, None]) / safe[:, None]), 0, LEVELS).astype(np.uint8)  # [K/32, 32, N]
    q = q.transpose(2, 0, 1)  # [N, K/32, 32]
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    scales = d.T.reshape(-1).astype(np.float32)
    return packed, scales, (low + 8 * d).astype(np.float32)


def holds_q4_1(model) -> bool:
    """Whether every linear weight in `model.layers` (else `model`) is Q4_1 blocks exactly (d * q + m).

    The LM head is not looked at: q4_1 graphs keep it int8 (a Q4_1 GGUF stores it as Q8_0).
    """
    import torch

    layers = getattr(model, "layers", model)
    linears = [m for m in layers.modules() if isinstance(m, torch.nn.Linear) and m.in_features % BLOCK == 0]
    if not linears:
        return False
    for linear in linears:
        w = linear.weight.detach().float().T.contiguous().numpy()  # [K, N] as in the ONNX MatMul
        packed, scales, correction = q4_min_blocks(w)
        if not np.array_equal(dequantize(packed, scales, correction), w):
            return False
    return True


def dequantize(packed: np.ndarray, scales: np.ndarray, correction: np.ndarray) -> np.ndarray:
    """Inverse of `q4_min_blocks` in float32: -> w [K, N]."""
    n, blocks, _ = packed.shape
    q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks, BLOCK).astype(np.float32)
    w = scales.reshape(n, blocks, 1) * (q - 8) + correction.T[:, :, None]
    return w.reshape(n, blocks * BLOCK).T


def _blocksum_nodes(graph, nodes: list, x: str, k: int) -> str:
    """Append the product x [..., K] @ S -> [..., K/32] (S [K, K/32]: ones where row k lies in block b), the sum
    of x over each block; a product, not a reshape, so x of any rank (rows of a batch) keeps its leading axes."""
    from onnx import helper, numpy_helper

    ones, out = f"{x}.block_ones", f"{x}.blocksum"
    blocks = (np.arange(k)[:, None] // BLOCK == np.arange(k // BLOCK)[None, :]).astype(np.float32)
    graph.initializer.append(numpy_helper.from_array(blocks, ones))
    nodes.append(helper.make_node("MatMul", [x, ones], [out], name=out))
    return out


def _padded_rows(graph, nodes: list, x: str, k: int) -> tuple[str, str]:
    """Append x [..., K] -> rows [M + 1, K] (x's rows, then a zero row); returns (rows, x's leading shape)."""
    from onnx import helper, numpy_helper

    consts = {f"{x}.as_rows": np.array([-1, k], np.int64), f"{x}.zero_row": np.zeros((1, k), np.float32),
              f"{x}.zero": np.array([0], np.int64), f"{x}.last": np.array([-1], np.int64)}
    graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in consts.items())
    rows, lead = f"{x}.rows", f"{x}.lead"
    nodes += [helper.make_node("Reshape", [x, f"{x}.as_rows"], [f"{x}.flat"], name=f"{x}.flat"),
              helper.make_node("Concat", [f"{x}.flat", f"{x}.zero_row"], [rows], name=rows, axis=0),
              helper.make_node("Shape", [x], [f"{x}.shape"], name=f"{x}.shape"),
              helper.make_node("Slice", [f"{x}.shape", f"{x}.zero", f"{x}.last"], [lead], name=lead)]
    return rows, lead


def _unpadded_rows(graph, y_rows: str, lead: str, n: int, y: str, name: str) -> list:
    """Nodes y_rows [M + 1, N] -> y [..., N]: the zero row dropped, x's leading axes restored."""
    from onnx import helper, numpy_helper

    consts = {f"{name}.zero": np.array([0], np.int64), f"{name}.last": np.array([-1], np.int64),
              f"{name}.n": np.array([n], np.int64)}
    graph.initializer.extend(numpy_helper.from_array(v, key) for key, v in consts.items())
    return [helper.make_node("Slice", [y_rows, f"{name}.zero", f"{name}.last", f"{name}.zero"], [f"{name}.rows"],
                             name=f"{name}.rows"),
            helper.make_node("Concat", [lead, f"{name}.n"], [f"{name}.shape"], name=f"{name}.shape", axis=0),
            helper.make_node("Reshape", [f"{name}.rows", f"{name}.shape"], [y], name=f"{name}.unpad")]
