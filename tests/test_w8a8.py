"""w8a8: int8 weights per column, int8 activations per row, an integer product (exporters.w8a8)."""

from __future__ import annotations

import numpy as np
import pytest

from mirror_rt.devices.registry import available_devices
from mirror_rt.exporters.w8a8 import WEIGHT_LEVELS, quantize_w8a8, weight_columns

needs_ort = pytest.mark.skipif(not available_devices()["onnxruntime"], reason="onnxruntime not installed")


def _matmul_model(w: np.ndarray, opset: int):
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj"), helper.make_node("MatMul", ["x", "w2"], ["y2"]),
         helper.make_node("MatMul", ["x", "w3"], ["y3"], name="kept")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, w.shape[0]])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y", "y2", "y3")],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w[:, :8].copy(), "w2"),
         numpy_helper.from_array(w[:, 8:16].copy(), "w3")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_weight_columns_round_each_column_to_its_own_scale():
    w = np.random.default_rng(0).standard_normal((32, 6)).astype(np.float32) * np.arange(1, 7)
    q, scales = weight_columns(w)
    assert q.dtype == np.int8 and np.abs(q).max() == WEIGHT_LEVELS
    assert np.all(np.abs(q * scales - w) <= scales / 2 + 1e-6)


@needs_ort
@pytest.mark.parametrize("opset", [17, 18])
def test_rewritten_matmuls_compute_the_product_row_by_row(opset):
    """Within 2% of x @ w; one quantization per input; a row's output is the same alone or in a batch; a zero
    row gives zeros (no 0/0); an excluded product stays fp32."""
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    model = quantize_w8a8(_matmul_model(w, opset), exclude=["kept"])
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulIntegerToFloat") == 2 and ops.count("QuantizeLinear") == 1 and ops.count("MatMul") == 1
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    x[1, 2] = 0.0
    y, y2, y3 = session.run(None, {"x": x})
    np.testing.assert_allclose(y, x @ w, atol=0.02 * np.abs(x @ w).max(), rtol=0)
    np.testing.assert_allclose(y2, x @ w[:, :8], atol=0.02 * np.abs(x @ w).max(), rtol=0)
    np.testing.assert_allclose(y3, x @ w[:, 8:16], rtol=1e-5, atol=1e-5)
    assert np.array_equal(y[1, 2], np.zeros(48, np.float32))
    alone = session.run(None, {"x": x[1:, 3:4]})[0]
    assert np.array_equal(alone[0, 0], y[1, 3])
