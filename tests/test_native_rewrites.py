"""exporters.native_rewrites.as_pool_attention: a draft's GroupQueryAttention over shared buffers rewritten onto
mirror-rt's PoolAttention attends alike (ONNX Runtime's sums against mirror-rt's fixed order: float rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from mirror_rt.devices.registry import available_devices

HEADS, KV_HEADS, DIM, CAPACITY, TABLE = 4, 2, 16, 24, 64

pytestmark = pytest.mark.skipif(not available_devices()["onnxruntime"], reason="onnxruntime not installed")


def gqa_model(kv_type=None):
    """One layer as exporters.shared_kv exports a draft's: GroupQueryAttention rotating q and k itself, its lengths and
    positions computed from total_len [B] (the positions each row holds after the call)."""
    from onnx import TensorProto, helper, numpy_helper

    kv = kv_type or TensorProto.FLOAT
    inv = 1.0 / 10000 ** (np.arange(0, DIM, 2) / DIM)
    angles = np.arange(TABLE)[:, None] * inv[None]
    initializers = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
                    numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
                    numpy_helper.from_array(np.array([1], np.int32), "one"),
                    numpy_helper.from_array(np.array([1], np.int64), "shape1"),
                    numpy_helper.from_array(np.array(0, np.int64), "zero"),
                    numpy_helper.from_array(np.array(1, np.int64), "step")]
    nodes = [
        helper.make_node("Sub", ["total_len", "one"], ["seqlens"]),
        helper.make_node("ReduceMax", ["total_len"], ["longest"], keepdims=0),
        helper.make_node("Reshape", ["longest", "shape1"], ["total"]),
        helper.make_node("Shape", ["q"], ["q_shape"]),
        helper.make_node("Gather", ["q_shape", "step"], ["tokens"], axis=0),
        helper.make_node("Range", ["zero", "tokens", "step"], ["offsets"]),
        helper.make_node("Cast", ["total_len"], ["total64"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["total64", "step"], ["ends"]),
        helper.make_node("Sub", ["ends", "tokens"], ["starts"]),
        helper.make_node("Add", ["starts", "offsets"], ["positions"]),
        helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens", "total", "cos",
                                                 "sin", "positions"], ["out", "present_key", "present_value"],
                         name="attention", domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS,
                         do_rotary=1),
    ]
    buffer = ["batch", KV_HEADS, CAPACITY, DIM]
    graph = helper.make_graph(
        nodes, "layer",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["batch", "window", HEADS * DIM]),
         helper.make_tensor_value_info("k", TensorProto.FLOAT, ["batch", "window", KV_HEADS * DIM]),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", "window", KV_HEADS * DIM]),
         helper.make_tensor_value_info("past_key", kv, buffer), helper.make_tensor_value_info("past_value", kv, buffer),
         helper.make_tensor_value_info("total_len", TensorProto.INT32, ["batch"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("present_key", kv, buffer),
         helper.make_tensor_value_info("present_value", kv, buffer)],
        initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def run_calls(model, calls: list) -> list:
    """Each call (q, k, v, total_len) on one session over buffers bound as past and present (as devices.onnxruntime
    binds them) -> [(out, keys, values)] after each call."""
    import onnxruntime as ort

    from mirror_rt.exporters import native_op

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    native_op.register(options)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    buffers = [ort.OrtValue.ortvalue_from_numpy(np.zeros((2, KV_HEADS, CAPACITY, DIM), np.float32)) for _ in range(2)]
    results = []
    for q, k, v, total_len in calls:
        binding = session.io_binding()
        for name, value in (("q", q), ("k", k), ("v", v), ("total_len", total_len)):
            binding.bind_cpu_input(name, value)
        binding.bind_output("out", "cpu")  # (get_outputs: in the order bound)
        for name, buffer in zip(("key", "value"), buffers):
            binding.bind_ortvalue_input(f"past_{name}", buffer)
            binding.bind_ortvalue_output(f"present_{name}", buffer)
        session.run_with_iobinding(binding)
        results.append((binding.get_outputs()[0].numpy(), buffers[0].numpy().copy(), buffers[1].numpy().copy()))
    return results


def layer_calls(rng) -> list:
    """A prompt of 5 tokens a row, then one token a row: the second row rolled back to 3 positions, then on."""
    def call(tokens, total_len):
        shape = (2, tokens)
        return (rng.standard_normal((*shape, HEADS * DIM)).astype(np.float32),
                rng.standard_normal((*shape, KV_HEADS * DIM)).astype(np.float32),
                rng.standard_normal((*shape, KV_HEADS * DIM)).astype(np.float32), np.array(total_len, np.int32))
    return [call(5, [5, 5]), call(1, [6, 4]), call(1, [7, 5])]


def test_a_drafts_group_query_attention_rewritten_onto_pool_attention_attends_alike():
    import onnx

    from mirror_rt.exporters import native_op
    from mirror_rt.exporters.native_rewrites import as_pool_attention

    if not native_op.available():
        pytest.skip("mirror-rt's ops cannot be built here (no C++ compiler)")
    model = gqa_model()
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert as_pool_attention(rewritten) == 1
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("RotaryEmbedding") == 2 and "PoolAttention" in ops
    assert not {"GroupQueryAttention", "ReduceMax", "Reshape"} & set(ops)  # the op's lengths' nodes dropped
    calls = layer_calls(np.random.default_rng(0))
    for (out, keys, values), (out2, keys2, values2) in zip(run_calls(model, calls), run_calls(rewritten, calls)):
        np.testing.assert_allclose(out2, out, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(keys2, keys, atol=1e-5, rtol=1e-5)  # rotated alike, at the same positions
        np.testing.assert_array_equal(values2, values)  # stored as given


def test_other_attention_is_left_alone():
    from onnx import TensorProto, helper

    from mirror_rt.exporters.native_rewrites import as_pool_attention

    sliding = gqa_model()
    node = [n for n in sliding.graph.node if n.op_type == "GroupQueryAttention"][0]
    node.attribute.append(helper.make_attribute("local_window_size", 8))  # not PoolAttention's attention
    for model in (sliding, gqa_model(TensorProto.FLOAT16)):  # float16 buffers: the op's q is float16 too
        nodes = [n.SerializeToString() for n in model.graph.node]
        assert as_pool_attention(model) == 0 and [n.SerializeToString() for n in model.graph.node] == nodes
