"""4-bit weights with a per-block minimum (Q4_1 layout) as MatMulNBits plus a block-sum correction."""

from __future__ import annotations

import numpy as np
import pytest

from mirror_rt.devices.registry import available_devices
from mirror_rt.exporters.q4_min import (
    BLOCK,
    dequantize,
    holds_q4_1,
    q4_min_blocks,
    quantize_q4_min,
)

needs_ort = pytest.mark.skipif(not available_devices()["onnxruntime"], reason="onnxruntime not installed")


def q4_1_weights(k: int, n: int, seed: int = 0) -> np.ndarray:
    """[K, N] weights as a Q4_1 GGUF stores them: per block of 32 along K, d * q + m (d, m in fp16)."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.001, 0.05, (k // BLOCK, 1, n)).astype(np.float16).astype(np.float32)
    m = -rng.uniform(0.0, 0.4, (k // BLOCK, 1, n)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (k // BLOCK, BLOCK, n))
    q[:, 0], q[:, 1] = 0, 15  # the block's min and max (llama.cpp sets d = (max - min) / 15)
    return (d * q + m).reshape(k, n).astype(np.float32)


def unpack(packed, scales, correction, k, n) -> np.ndarray:
    assert packed.shape == (n, k // BLOCK, BLOCK // 2) and scales.shape == (n * k // BLOCK,)
    return dequantize(packed, scales, correction)


def test_q4_1_weights_are_recovered_exactly():
    w = q4_1_weights(96, 40)
    np.testing.assert_array_equal(unpack(*q4_min_blocks(w), 96, 40), w)


def test_holds_q4_1_tells_q4_1_models_from_others():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 40, bias=False), torch.nn.Linear(40, 64, bias=False))
    assert not holds_q4_1(model)  # random fp32 weights
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(q4_1_weights(64, 40, seed=4).T.copy()))
    assert holds_q4_1(model)  # the 40-wide input of the second layer is not a whole number of blocks: ignored


def test_other_weights_round_to_the_nearest_level():
    w = np.random.default_rng(1).standard_normal((64, 24)).astype(np.float32)
    step = (w.reshape(2, BLOCK, 24).max(1) - w.reshape(2, BLOCK, 24).min(1)) / 15
    error = np.abs(unpack(*q4_min_blocks(w), 64, 24) - w).reshape(2, BLOCK, 24).max(1)
    assert np.all(error <= step / 2 + 1e-6)


def _matmul_model(w: np.ndarray, rank: int):
    from onnx import TensorProto, helper, numpy_helper

    shape = [None, w.shape[0]] if rank == 2 else [None, None, w.shape[0]]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj"), helper.make_node("MatMul", ["x", "w2"], ["y2"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y", "y2")],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w[:, :8].copy(), "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@needs_ort
@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("accuracy_level,tolerance", [(0, 1e-5), (4, 3e-2)])
def test_rewritten_matmul_computes_the_q4_1_product(rank, accuracy_level, tolerance):
    """fp32 compute equals x @ w to rounding; int8 activations (level 4) stay within a few percent."""
    import onnxruntime as ort

    w = q4_1_weights(64, 48, seed=2)
    model = quantize_q4_min(_matmul_model(w, rank), exclude=[], accuracy_level=accuracy_level)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 2 and len([n for n in model.graph.node if n.name.endswith(".blocksum")]) == 1
    # one block sum per input
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    x = x if rank == 2 else np.stack([x, x[::-1]])  # rows of a batch keep their own block sums
    y, y2 = session.run(None, {"x": x})
    scale = np.abs(x @ w).max()
    np.testing.assert_allclose(y, x @ w, atol=tolerance * scale, rtol=0)
    np.testing.assert_allclose(y2, x @ w[:, :8], atol=tolerance * scale, rtol=0)


@needs_ort
@pytest.mark.parametrize("rank", [2, 3])
def test_row_invariant_products_compute_a_row_alike_in_any_call_shape(rank):
    """Targets' form: a row's bits are the same alone (one row), in a batch and in a window; the rewritten product
    still equals x @ w to int8 rounding. Without it MLAS's one-row 4-bit kernel differs on AVX2 CPUs."""
    import onnxruntime as ort

    w = q4_1_weights(64, 48, seed=4)
    model = quantize_q4_min(_matmul_model(w, rank), exclude=[], accuracy_level=4, row_invariant=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(5).standard_normal((6, 64)).astype(np.float32)
    x = x if rank == 2 else x.reshape(2, 3, 64)
    together, together2 = session.run(None, {"x": x})
    assert together.shape == x.shape[:-1] + (48,) and together2.shape == x.shape[:-1] + (8,)
    for index in np.ndindex(x.shape[:-1]):
        alone, alone2 = session.run(None, {"x": x[index].reshape((1,) * (rank - 1) + (64,))})
        assert np.array_equal(alone.reshape(-1), together[index]) and np.array_equal(alone2.reshape(-1),
                                                                                      together2[index])
    np.testing.assert_allclose(together, x @ w, atol=3e-2 * np.abs(x @ w).max(), rtol=0)


def gguf_q4_1_rows(w: np.ndarray) -> np.ndarray:
    """`q4_1_weights` as a GGUF file stores them: rows [N, K/32 * 20] of Q4_1 blocks (gguf-py's quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(np.ascontiguousarray(w.T), GGMLQuantizationType.Q4_1)


@needs_ort
@pytest.mark.parametrize("rank", [2, 3])
def test_q4_1_products_rewritten_onto_matmul_gguf_read_the_files_blocks_and_compute_alike(rank):
    """A q4_1 graph's products (MatMulNBits, block sums, sum) become one MatMulGGUF each over GGUF Q4_1 blocks: the
    very bytes a GGUF file holds for those weights, and the product MatMulNBits computes (both int8 activations per
    block of 32, rounded their own ways)."""
    import onnxruntime as ort

    from mirror_rt.exporters import native_op
    from mirror_rt.exporters.q4_min import Q4_1_TYPE, as_gguf_q4_1

    if not native_op.available():
        pytest.skip("mirror-rt's ops cannot be built here (no C++ compiler)")
    w = q4_1_weights(64, 48, seed=6)
    model = quantize_q4_min(_matmul_model(w, rank), exclude=[], accuracy_level=4)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert as_gguf_q4_1(model) == 2
    assert sorted(n.op_type for n in model.graph.node) == ["MatMulGGUF", "MatMulGGUF"]  # block sums dropped
    blocks = {t.name: t for t in model.graph.initializer}["proj.q4_1"]
    from onnx import numpy_helper

    assert np.array_equal(numpy_helper.to_array(blocks), gguf_q4_1_rows(w))
    assert {n.name: {a.name: a.i for a in n.attribute} for n in model.graph.node}["proj.gguf"] == {
        "type": Q4_1_TYPE, "k": 64}
    options = ort.SessionOptions()
    native_op.register(options)
    rewritten = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(7).standard_normal((5, 64)).astype(np.float32)
    x = x if rank == 2 else np.stack([x, x[::-1]])
    scale = np.abs(x @ w).max()
    for before, after, exact in zip(session.run(None, {"x": x}), rewritten.run(None, {"x": x}), (x @ w, x @ w[:, :8])):
        np.testing.assert_allclose(after, exact, atol=3e-2 * scale, rtol=0)
        np.testing.assert_allclose(after, before, atol=2e-2 * scale, rtol=0)


def test_a_graph_without_q4_1_products_is_left_alone():
    from mirror_rt.exporters.q4_min import as_gguf_q4_1

    model = _matmul_model(q4_1_weights(64, 48), 2)
    nodes = [n.SerializeToString() for n in model.graph.node]
    assert as_gguf_q4_1(model) == 0 and [n.SerializeToString() for n in model.graph.node] == nodes


def q8_head_model(k: int, n: int, seed: int = 0):
    """A q4_1 bundle's head as its exporter writes it: MatMulNBits, 8 bits, blocks of 32, no zero points (w = scale
    (q - 128)), scales halves as a Q8_0 GGUF keeps them, each block reaching +-127 (so gguf-py finds the same scale);
    -> (model, w [K, N])."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    levels = rng.integers(-127, 128, (n, k // BLOCK, BLOCK))
    levels[..., 0] = np.where(rng.random((n, k // BLOCK)) < 0.5, -127, 127)
    scales = rng.uniform(0.001, 0.02, (n, k // BLOCK)).astype(np.float16).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "head.q8", "head.scales"], ["logits"], name="head",
                            domain="com.microsoft", K=k, N=n, bits=8, block_size=BLOCK, accuracy_level=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array((levels + 128).astype(np.uint8), "head.q8"),
                               numpy_helper.from_array(scales, "head.scales")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model, (scales[..., None] * levels).reshape(n, k).T.astype(np.float32)


@needs_ort
def test_an_8_bit_head_rewritten_onto_matmul_gguf_reads_q8_0_blocks_and_computes_alike():
    """A q4_1 draft's 8-bit head (MatMulNBits, zero point 128) becomes a MatMulGGUF over GGUF Q8_0 blocks: the very
    bytes gguf-py's quantizer writes for those weights, and the product MatMulNBits computes (both int8 activations per
    block of 32, rounded their own ways); a 4-bit product is not its business."""
    import onnxruntime as ort
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from onnx import numpy_helper

    from mirror_rt.exporters import native_op
    from mirror_rt.exporters.native_rewrites import Q8_0_TYPE, as_gguf_q8_0

    if not native_op.available():
        pytest.skip("mirror-rt's ops cannot be built here (no C++ compiler)")
    model, w = q8_head_model(128, 80, seed=3)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert as_gguf_q8_0(model) == 1
    assert [(n.op_type, {a.name: a.i for a in n.attribute}) for n in model.graph.node] == [
        ("MatMulGGUF", {"type": Q8_0_TYPE, "k": 128})]
    assert [t.name for t in model.graph.initializer] == ["head.q8_0"]  # MatMulNBits' weights gone
    blocks = numpy_helper.to_array(model.graph.initializer[0])
    assert np.array_equal(blocks, quantize(np.ascontiguousarray(w.T), GGMLQuantizationType.Q8_0))
    options = ort.SessionOptions()
    native_op.register(options)
    rewritten = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(4).standard_normal((6, 128)).astype(np.float32)
    (before,), (after,) = session.run(None, {"x": x}), rewritten.run(None, {"x": x})
    scale = np.abs(x @ w).max()
    np.testing.assert_allclose(after, x @ w, atol=2e-2 * scale, rtol=0)
    np.testing.assert_allclose(after, before, atol=2e-2 * scale, rtol=0)
    q4 = quantize_q4_min(_matmul_model(q4_1_weights(64, 48), 2), exclude=[], accuracy_level=4)
    nodes = [n.SerializeToString() for n in q4.graph.node]
    assert as_gguf_q8_0(q4) == 0 and [n.SerializeToString() for n in q4.graph.node] == nodes


@needs_ort
def test_a_cpu_draft_runs_its_q4_1_products_rewritten_once_where_the_kernels_repack_q4_1(tmp_path, monkeypatch):
    """devices: the rewritten graph is written once into the bundle's .cache (weights in weights.bin, mapped where
    they lie), found again by the next load, and the exported graph is kept where the kernels do not repack Q4_1."""
    import onnx

    from mirror_rt.devices.onnxruntime import session as ort_session
    from mirror_rt.exporters import native_op

    if not native_op.available():
        pytest.skip("mirror-rt's ops cannot be built here (no C++ compiler)")
    w = q4_1_weights(64, 48, seed=8)
    path = tmp_path / "draft.onnx"
    onnx.save(quantize_q4_min(_matmul_model(w, 2), exclude=[], accuracy_level=4), str(path))
    monkeypatch.setattr(native_op, "repacks", lambda kind, variant=None: False)
    assert ort_session.gguf_draft(path) == path
    looked = list((tmp_path / ".cache" / "gguf").glob(f"*/{ort_session.AS_EXPORTED}"))  # nothing to rewrite, once
    monkeypatch.setattr(onnx, "load", lambda *a, **k: pytest.fail("the graph read again"))
    assert len(looked) == 1 and ort_session.gguf_draft(path) == path
    monkeypatch.undo()
    monkeypatch.setattr(native_op, "repacks", lambda kind, variant=None: kind == 3)
    rewritten = ort_session.gguf_draft(path)
    assert rewritten.parent.parent == tmp_path / ".cache" / "gguf" and (rewritten.parent / "weights.bin").is_file()
    assert [n.op_type for n in onnx.load(str(rewritten), load_external_data=False).graph.node] == ["MatMulGGUF"] * 2
    made = rewritten.stat().st_mtime_ns
    assert ort_session.gguf_draft(path) == rewritten and rewritten.stat().st_mtime_ns == made
    monkeypatch.setattr(native_op, "repacks", lambda kind, variant=None: kind in (3, 8))  # the rewrites differ:
    assert ort_session.gguf_draft(path) not in (path, rewritten)  # a graph of its own
    import onnxruntime as ort

    options = ort.SessionOptions()
    native_op.register(options)
    x = np.random.default_rng(9).standard_normal((3, 64)).astype(np.float32)
    y, _ = ort.InferenceSession(str(rewritten), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y, x @ w, atol=3e-2 * np.abs(x @ w).max(), rtol=0)
