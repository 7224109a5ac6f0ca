"""mirror-rt's ONNX Runtime ops (exporters/pool_attention.cpp): attention read in place, rows quantized in one node.

The kernel is called through ctypes and through ONNX Runtime; its contract is bitwise: a query's output depends
on its own row's keys up to its position only, never on the call's other rows or tokens or on stale slots."""

import ctypes

import numpy as np
import pytest

from mirror_rt.exporters import native_op

pytestmark = pytest.mark.skipif(not native_op.available(), reason="no C++ compiler to build the op")


def kernel(half: bool = False, variant: str | None = None):
    lib = ctypes.CDLL(str(native_op.library(variant=variant)))
    f = lib.mirror_rt_pool_attention_half if half else lib.mirror_rt_pool_attention
    f.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6
    return f


def attend(q, keys, values, positions, new=None, variant=None):
    """The op over float32 keys and values, or float16 ones (PoolAttentionHalf); `new` = (k, v) [B, T, KVH*D]: the
    call's keys and values, stored into `keys` and `values` first (in place)."""
    B, T, width = q.shape
    _, kv_heads, capacity, dim = keys.shape
    out = np.full_like(q, np.nan)
    q, positions = np.ascontiguousarray(q), np.ascontiguousarray(positions)
    assert keys.flags.c_contiguous and values.flags.c_contiguous
    k, v = (None, None) if new is None else (np.ascontiguousarray(x, dtype=np.float32) for x in new)
    pointers = [None if a is None else a.ctypes.data for a in (q, k, v, keys, values, positions, out)]
    kernel(keys.dtype == np.float16, variant)(*pointers, B, T, width // dim, kv_heads, capacity, dim)
    return out


def reference(q, keys, values, positions):
    """Causal attention in float64: query (b, t) over keys 0..positions[b, t] of row b."""
    B, T, width = q.shape
    _, kv_heads, _, dim = keys.shape
    heads = width // dim
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            n = positions[b, t] + 1
            for h in range(heads):
                kv = h // (heads // kv_heads)
                scores = keys[b, kv, :n].astype(np.float64) @ q[b, t, h * dim:(h + 1) * dim] / np.sqrt(dim)
                weights = np.exp(scores - scores.max())
                out[b, t, h * dim:(h + 1) * dim] = weights / weights.sum() @ values[b, kv, :n]
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("dim,heads,kv_heads",
                         [(64, 9, 3), (64, 4, 4), (128, 8, 2), (32, 16, 2), (16, 4, 2), (12, 6, 2)])
def test_matches_float64_attention(dim, heads, kv_heads, dtype):
    """The vectorized paths (AVX-512: head sizes 32, 64, 96, 128, up to 8 query heads a KV head; AVX2: head sizes
    a multiple of 16) and the plain one (the others, or the portable variant), against causal attention computed in
    float64."""
    rng = np.random.default_rng(dim + heads)
    B, T, capacity = 3, 5, 90
    keys, values = (rng.standard_normal((B, kv_heads, capacity, dim)).astype(dtype) for _ in range(2))
    keys[0, 0, 3, :2] = np.float16(3e-6)  # a float16 subnormal (exact in float32 too)
    q = rng.standard_normal((B, T, heads * dim), dtype=np.float32)
    positions = np.array([[p - T + 1 + t for t in range(T)] for p in (20, 89, 4)], dtype=np.int64)
    assert np.abs(attend(q, keys, values, positions) - reference(q, keys, values, positions)).max() < 2e-6


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("dim", [64, 128, 16])
def test_a_query_computes_alike_in_every_call_shape(dim, dtype):
    """Bitwise: each query of a 3-row, 7-token call equals itself alone in a one-token call, in a window of its
    row, and after the slots past its position were overwritten; long rows go through the threaded path."""
    rng = np.random.default_rng(dim)
    B, T, capacity, kv_heads, heads = 3, 7, 3000, 2, 6
    keys, values = (rng.standard_normal((B, kv_heads, capacity, dim)).astype(dtype) for _ in range(2))
    q = rng.standard_normal((B, T, heads * dim), dtype=np.float32)
    positions = np.array([[end - T + t for t in range(T)] for end in (10, 2999, 700)], dtype=np.int64)
    native_op.set_threads(2)
    together = attend(q, keys, values, positions)
    for b in range(B):
        window = attend(q[b:b + 1, 2:], keys[b:b + 1].copy(), values[b:b + 1].copy(), positions[b:b + 1, 2:])
        assert np.array_equal(window[0], together[b, 2:])
        for t in range(T):
            stale_keys, stale_values = keys[b:b + 1].copy(), values[b:b + 1].copy()
            stale_keys[:, :, positions[b, t] + 1:] = 7.0
            stale_values[:, :, positions[b, t] + 1:] = -7.0
            alone = attend(q[b:b + 1, t:t + 1], stale_keys, stale_values, positions[b:b + 1, t:t + 1])
            assert np.array_equal(alone[0, 0], together[b, t]), (b, t)


def subnormal_product() -> float:
    """1e-30 x 1e-10 in float32 on this thread: a subnormal, or 0 where the thread flushes them."""
    return float(np.float32(1e-30) * np.float32(1e-10))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_query_computes_alike_whatever_float_mode_the_caller_is_in(dtype):
    """Bitwise, where only subnormals carry a query's output (scores hundreds apart: every weight but the top one
    clamped near 1e-38, and the top key's value zero): a call from a thread that flushes subnormals
    (torch.set_flush_denormal, as a host process may) equals a call from one that does not. Each thread that attends
    flushes them itself (the caller's queries and its helpers' alike), then puts the caller's mode back."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    B, T, capacity, heads, dim = 2, 6, 5000, 2, 64
    keys, values = (rng.standard_normal((B, heads, capacity, dim)).astype(dtype) for _ in range(2))
    q = rng.standard_normal((B, T, heads * dim), dtype=np.float32) * 400.0
    positions = np.array([[end - T + t for t in range(T)] for end in (4999, 3000)], dtype=np.int64)
    for b, t, h in np.ndindex(B, T, heads):  # the top key's value zero: the output is the clamped weights' sum
        scores = keys[b, h, :positions[b, t] + 1].astype(np.float32) @ q[b, t, h * dim:(h + 1) * dim]
        values[b, h, scores.argmax()] = 0
    native_op.set_threads(2)  # over 4096 keys: the caller takes one range of queries, a helper the other
    assert subnormal_product() != 0.0
    plain = attend(q, keys, values, positions)
    assert subnormal_product() != 0.0  # the caller's mode put back
    assert torch.set_flush_denormal(True)
    try:
        assert subnormal_product() == 0.0
        flushing = attend(q, keys, values, positions)
        assert subnormal_product() == 0.0
    finally:
        torch.set_flush_denormal(False)
    assert np.array_equal(flushing, plain)


@pytest.mark.skipif("avx2" not in native_op.runnable_variants(), reason="this CPU lacks AVX2: the avx2 variant not run")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (64, 8, 1), (128, 5, 5), (32, 14, 2), (16, 4, 4),
                                                (48, 6, 2), (12, 6, 2)])
def test_the_avx2_path_gives_the_portable_bits(dim, heads, kv_heads, dtype):
    """The AVX2 variant attends with the portable path's float operations in the same order: the same bits, over
    rows of any length (long ones through the threaded path), scores far apart (e^x clamped), subnormal keys."""
    rng = np.random.default_rng(dim * heads)
    B, T, capacity = 3, 4, 2100
    keys, values = (rng.standard_normal((B, kv_heads, capacity, dim)).astype(dtype) for _ in range(2))
    keys[1, 0, 5, :3] = np.float16(3e-6)
    q = rng.standard_normal((B, T, heads * dim), dtype=np.float32)
    q[2] *= 40.0  # scores hundreds apart: most weights underflow through the clamp at -87
    positions = np.array([[p - T + 1 + t for t in range(T)] for p in (3, 2099, 37)], dtype=np.int64)
    for variant in ("portable", "avx2"):  # each library's calls split over 2 threads (rows over 4096 keys)
        ctypes.CDLL(str(native_op.library(variant=variant))).mirror_rt_ops_threads(2)
    portable = attend(q, keys, values, positions, variant="portable")
    assert np.array_equal(attend(q, keys, values, positions, variant="avx2"), portable)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_op_stores_the_calls_keys_and_values(dtype):
    """Given this call's keys and values, the op stores them at each token's position (float16 buffers: rounded to
    nearest, ties to even, as numpy rounds) and attends as over buffers written beforehand; other slots untouched."""
    rng = np.random.default_rng(5)
    B, T, kv_heads, heads, dim, capacity = 2, 3, 2, 4, 64, 40
    k, v = (rng.standard_normal((B, T, kv_heads * dim), dtype=np.float32) * 3 for _ in range(2))
    k[0, 0, :4] = [1e-6, 65519.0, -3.0009765625, 2.0 ** -25]  # a subnormal, to the largest finite, a tie, a tie to 0
    positions = np.array([[7, 8, 9], [30, 31, 32]], dtype=np.int64)
    q = rng.standard_normal((B, T, heads * dim), dtype=np.float32)
    keys, values = (rng.standard_normal((B, kv_heads, capacity, dim)).astype(dtype) for _ in range(2))
    written_keys, written_values = keys.copy(), values.copy()
    for b in range(B):
        for t in range(T):
            written_keys[b, :, positions[b, t]] = k[b, t].reshape(kv_heads, dim).astype(dtype)
            written_values[b, :, positions[b, t]] = v[b, t].reshape(kv_heads, dim).astype(dtype)
    stored = attend(q, keys, values, positions, new=(k, v))
    assert np.array_equal(keys, written_keys) and np.array_equal(values, written_values)
    assert np.array_equal(stored, attend(q, written_keys, written_values, positions))


def test_quantize_rows_equals_the_standard_ops():
    """QuantizeRows gives the bits of exporters.w8a8's six standard ops (zero rows and ties included)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from mirror_rt.exporters.w8a8 import _constants, _quantize_rows

    graph = helper.make_graph([], "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 100])], [])
    nodes = []
    standard = _quantize_rows(nodes, "x", _constants(graph, axes_input=True))
    nodes.append(helper.make_node(native_op.QUANTIZE_ROWS, ["x"], ["q", "scale"], domain=native_op.DOMAIN))
    graph.node.extend(nodes)
    graph.output.extend(helper.make_tensor_value_info(name, kind, None) for name, kind in
                        ((standard[0], TensorProto.UINT8), (standard[1], TensorProto.FLOAT),
                         ("q", TensorProto.UINT8), ("scale", TensorProto.FLOAT)))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(native_op.DOMAIN, 1)])
    model.ir_version = 8  # as the exporters write it: a newer onnx's default can pass what its ONNX Runtime reads
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native_op.library()))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for trial in range(50):
        x = (rng.standard_normal((3, 4, 100)) * rng.uniform(0.01, 50)).astype(np.float32)
        x[0, 0] = 0.0
        x[1, 2, :8] = np.float32(0.5) * np.abs(x[1, 2]).max()  # x / scale = 63.5: a tie, rounded to even
        q_standard, scale_standard, q, scale = session.run(None, {"x": x})
        assert np.array_equal(q, q_standard) and np.array_equal(scale, scale_standard), trial


def test_without_a_compiler_it_says_why(monkeypatch, tmp_path):
    """No compiler: one line naming what to install, and exports fall back to the standard-op graphs."""
    from mirror_rt.exporters.export import _attention
    from mirror_rt.exporters.export_config import ExportConfig

    monkeypatch.setattr(native_op, "compiler", lambda: None)
    with pytest.raises(native_op.NativeOpUnavailable, match="^no C\\+\\+ compiler to build mirror-rt's CPU kernels: "
                       "(apt-get install g\\+\\+|.*) \\(or set \\$CXX to one\\)$"):
        native_op.library(tmp_path)
    assert _attention(ExportConfig(model="tiny", out_dir=tmp_path / "b")) == "standard"
    with pytest.raises(ValueError, match="--attention pool: no C\\+\\+ compiler"):
        _attention(ExportConfig(model="tiny", out_dir=tmp_path / "b", attention="pool"))


def test_a_failing_build_says_why_in_one_line(monkeypatch, tmp_path):
    """A compiler that fails: its first error line, and nothing half-built left in the cache."""
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\necho 'x.cpp:1:1: error: something broke' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(native_op.NativeOpUnavailable, match="failed: x.cpp:1:1: error: something broke$"):
        native_op.library(tmp_path)
    assert not list((tmp_path / "native").iterdir())


def test_a_gguf_export_without_a_compiler_stops_before_it_starts(monkeypatch, tmp_path):
    """No compiler on PATH: a GGUF export says what to install in one line before reading its weights (GGUF graphs
    run on the kernels only; `--attention standard` is no way out for them)."""
    from mirror_rt.exporters.export import export_bundle
    from mirror_rt.exporters.export_config import ExportError

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++, no c++
    assert native_op.compiler() is None
    from test_gguf_header import write_small_gguf

    model = write_small_gguf(tmp_path / "model.gguf")  # a valid header: only the kernels are missing
    with pytest.raises(ExportError) as caught:
        export_bundle(str(model), tmp_path / "bundle", progress=False)
    message = str(caught.value)
    assert "\n" not in message and "no C++ compiler" in message and "install" in message, message
    assert "--attention standard" not in message
    assert not (tmp_path / "bundle").exists()


def test_a_cxx_naming_no_program_says_so(monkeypatch, tmp_path):
    """$CXX set to a missing binary: said in one line, not silently another compiler."""
    monkeypatch.setenv("CXX", str(tmp_path / "missing-g++"))
    with pytest.raises(native_op.NativeOpUnavailable, match="^\\$CXX=.*missing-g\\+\\+: no such program here"):
        native_op.library(tmp_path)
    monkeypatch.setenv("CXX", "ccache-nowhere g++")
    with pytest.raises(native_op.NativeOpUnavailable, match="ccache-nowhere g\\+\\+: no such program"):
        native_op.require()


def test_the_first_build_says_so_in_one_line(monkeypatch, tmp_path, capfd):
    fake = tmp_path / "cxx"  # a compiler that writes an empty library where asked
    fake.write_text('#!/bin/sh\nfor a; do [ "$last" = -o ] && touch "$a"; last=$a; done\nexit 0\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    native_op.library(tmp_path, variant="portable")
    assert capfd.readouterr().err == "compiling mirror-rt's CPU kernels (portable), ~1 min, once\n"
    native_op.library(tmp_path, variant="portable")  # built: nothing said
    assert capfd.readouterr().err == ""


def _gguf_session(weights_file, type_: int, k: int, n: int, row_bytes: int):
    """An ONNX Runtime session of one MatMulGGUF over `weights_file` (external data: mapped, as a bundle's)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    w = TensorProto(name="w", data_type=TensorProto.UINT8, dims=[n, row_bytes], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", weights_file.name), ("offset", "0"), ("length", str(n * row_bytes))):
        w.external_data.add(key=key, value=value)
    node = helper.make_node("MatMulGGUF", ["x", "w"], ["y"], domain="mirror_rt", type=type_, k=k)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mirror_rt", 1)])
    path = weights_file.with_suffix(".onnx")
    onnx.save(model, str(path))
    options = ort.SessionOptions()
    native_op.register(options, threads=2)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _resident_bytes(name: str) -> int:
    """This process's resident bytes of the mappings of a file called `name` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as maps:
        for line in maps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                inside = len(fields) >= 6 and fields[5].endswith(name)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0"])
def test_a_session_multiplies_by_weights_repacked_once_and_holds_them_once(kind, tmp_path):
    """Through ONNX Runtime, a GGUF matrix in a mapped file: every number of rows gives the portable kernels' bits,
    and where this CPU's variant repacks the weights (AVX-512), the file's pages are released once repacked (the
    products read the repacking), and a second session over the same file computes alike."""
    from gguf import GGMLQuantizationType as T
    from test_gguf_kernels import activations, matmul, weights

    type_ = getattr(T, kind)
    k, n = 1024, 2048
    w = weights(type_, n, k, 12)
    weights_file = tmp_path / "weights.bin"
    weights_file.write_bytes(w.tobytes())
    x = activations(33, k, 13)
    reference = matmul("portable", x, w, type_, n)
    sessions = [_gguf_session(weights_file, int(type_), k, n, w.shape[1]) for _ in range(2)]
    for session in sessions:
        for rows in (1, 5, 8, 17, 33):
            assert np.array_equal(session.run(None, {"x": x[:rows]})[0], reference[:rows]), rows
    repacks = native_op.chosen_variant().startswith("avx512")
    resident = _resident_bytes("weights.bin")
    if repacks:
        assert resident < w.nbytes // 10, resident
    else:
        assert resident >= w.nbytes // 2, resident  # read as it lies: the products keep its pages
