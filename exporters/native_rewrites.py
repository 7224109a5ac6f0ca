"""An exported graph's layers rewritten onto mirror-rt's ONNX Runtime ops where they build (a CPU session of the
default q4_1 draft: devices.onnxruntime.session.gguf_draft, with exporters.q4_min.as_gguf_q4_1): its 8-bit products
onto MatMulGGUF over GGUF Q8_0 blocks, its GroupQueryAttention onto PoolAttention. Each returns how many it
rewrote and leaves anything it does not know as it is. No torch here: a bundle's run imports none.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # values a block (MatMulNBits' block_size that Q8_0 takes)
CONTRIB = "com.microsoft"  # ONNX Runtime's contrib ops (RotaryEmbedding), as exporters.shared_kv.DOMAIN

Q8_0_TYPE = 8  # GGML's type number of Q8_0 blocks (MatMulGGUF's `type`)


def as_gguf_q8_0(model) -> int:
    """Each 8-bit product MatMulNBits computes with blocks of 32 and no zero points (w = scale (q - 128): a q4_1
    bundle's head) as one mirror-rt MatMulGGUF over the same weights as GGUF Q8_0 blocks (the scale as a half, then
    q - 128 as int8); in place, returns how many. Both quantize the activations per block of 32 (accuracy level 4);
    the scales round to halves, so the products differ from MatMulNBits' by that rounding (for a draft: acceptance,
    never the output)."""
    from onnx import helper, numpy_helper

    from mirror_rt.exporters.native_op import DOMAIN

    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    nodes, blocks = [], []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = [name for name in node.input if name]
        if (node.op_type != "MatMulNBits" or attrs.get("bits") != 8 or attrs.get("block_size") != BLOCK
                or len(inputs) != 3 or inputs[1] not in weights or inputs[2] not in weights or attrs["K"] % BLOCK):
            nodes.append(node)
            continue
        k, n = attrs["K"], attrs["N"]
        q = numpy_helper.to_array(weights[inputs[1]]).reshape(n, k // BLOCK, BLOCK)
        scales = numpy_helper.to_array(weights[inputs[2]]).reshape(n, k // BLOCK)
        name = f"{node.name or node.output[0]}.q8_0"
        blocks.append(numpy_helper.from_array(q8_0_blocks(q, scales), name))
        nodes.append(helper.make_node("MatMulGGUF", [node.input[0], name], [node.output[0]],
                                      name=f"{node.name or node.output[0]}.gguf", domain=DOMAIN, type=Q8_0_TYPE, k=k))
    if not blocks:
        return 0
    replace_graph(model, nodes, blocks)
    return len(blocks)


def q8_0_blocks(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MatMulNBits' 8-bit rows (q [N, K/32, 32], zero point 128) with their scales [N, K/32] as GGUF Q8_0 rows
    [N, K/32 * 34]: the scale as a half, then q - 128 as int8."""
    n, blocks, _ = q.shape
    out = np.empty((n, blocks, 34), dtype=np.uint8)
    out[..., 0:2] = scales.astype(np.float16).view(np.uint8).reshape(n, blocks, 2)
    out[..., 2:] = q ^ 0x80  # (q - 128) as int8, in two's complement
    return out.reshape(n, blocks * 34)


def replace_graph(model, nodes: list, blocks: list = ()) -> None:
    """The graph's nodes become `nodes` (those whose outputs nothing reads dropped), its initializers those they
    read plus `blocks`; mirror-rt's opset declared."""
    from onnx import helper

    from mirror_rt.exporters.native_op import DOMAIN

    graph = model.graph
    nodes = _live(nodes, {o.name for o in graph.output})
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept + list(blocks))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def _live(nodes: list, outputs: set) -> list:
    """`nodes` without those whose outputs nothing reads (a graph output or another node's input), repeatedly."""
    while True:
        read = {name for node in nodes for name in node.input} | outputs
        live = [node for node in nodes if any(name in read for name in node.output)]
        if len(live) == len(nodes):
            return live
        nodes = live


def as_pool_attention(model) -> int:
    """Each GroupQueryAttention over float32 shared buffers that rotates q and k itself (a draft's, as
    `shared_kv_rope_attention` exports it) as two RotaryEmbedding nodes and one mirror_rt::PoolAttention over the same
    buffers, in place, at the op's own positions; the nodes that fed only the op's lengths dropped. In place, returns
    how many. The same attention (each query over its row's keys up to its position, scale 1/sqrt(D)), summed in
    mirror-rt's fixed order instead of ONNX Runtime's: a draft's numerics, never the output. mirror-rt's ONNX Runtime
    ops only (exporters.native_op)."""
    from onnx import TensorProto, helper

    from mirror_rt.exporters.native_op import DOMAIN as OPS
    from mirror_rt.exporters.native_op import OP

    graph = model.graph
    buffers = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    nodes, count = [], 0
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        kind = buffers.get(node.input[3]) if node.op_type == "GroupQueryAttention" and len(node.input) >= 10 else None
        if (kind != TensorProto.FLOAT or attrs.get("do_rotary") != 1
                or set(attrs) - {"num_heads", "kv_num_heads", "do_rotary", "rotary_interleaved"}
                or attrs.get("rotary_interleaved", 0) != 0 or not all(node.input[:10])):
            nodes.append(node)
            continue
        q, k, v, past_k, past_v, _, _, cos, sin, positions = node.input[:10]
        rotated = [f"{node.name}.rotated_q", f"{node.name}.rotated_k"]
        for x, out, heads in ((q, rotated[0], attrs["num_heads"]), (k, rotated[1], attrs["kv_num_heads"])):
            nodes.append(helper.make_node("RotaryEmbedding", [x, positions, cos, sin], [out], name=f"{out}.rope",
                                          domain=CONTRIB, interleaved=0, num_heads=heads))
        nodes.append(helper.make_node(OP, [*rotated, v, past_k, past_v, positions], list(node.output[:3]),
                                      name=f"{node.name}.pool", domain=OPS))
        count += 1
    if count:
        replace_graph(model, nodes)
    return count
