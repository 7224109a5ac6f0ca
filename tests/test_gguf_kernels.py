"""MatMulGGUF's kernels in each CPU variant (exporters.native_op.VARIANTS), called through ctypes.

Every variant this CPU runs is built and tested: exact integer sums per block against numpy, a row's bits the
same alone or in any tile of rows and with threads, and the portable variant's bits in the AVX2 one (they follow
the same arithmetic). The AVX-512 VNNI kernels sum floats in their own lanes: within 1e-5 of the largest output
there, except Q4_K and Q6_K, whose blocks they sum exactly: the portable bits, as the AMX variant's tiles (16 rows
and more) give them.
Variants the CPU lacks are skipped saying so, but are still compiled (where the compiler takes their flags).
"""

from __future__ import annotations

import functools
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mirror_rt.exporters import native_op

pytestmark = pytest.mark.skipif(native_op.compiler() is None, reason="no C++ compiler to build the kernels")

BLOCK_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
RUNNABLE = native_op.runnable_variants()
SAME_BITS_AS_PORTABLE = ("portable", "avx2")  # the AVX-512 VNNI kernels: within TOLERANCE
TOLERANCE = 1e-5  # of the largest |output|: float sums in other lanes
AMX_TYPES = (T.Q4_K, T.Q6_K)  # the AMX variant's tile products; these, in every variant: the portable bits
REPACKED_TYPES = (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)  # repacked (AVX-512 variants): portable bits


def portable_bits(variant: str, kind) -> bool:
    """Whether `variant` promises the portable kernels' bits for `kind` (else: within TOLERANCE)."""
    return (variant in SAME_BITS_AS_PORTABLE or kind in (T.Q5_0, T.Q5_1, T.Q5_K) or kind in FLOAT_TYPES
            or kind in AMX_TYPES)


def runs_here(variant: str):
    lacks = sorted(set(native_op.VARIANTS[variant][1]) - native_op.cpu_flags())
    return pytest.param(variant, marks=pytest.mark.skipif(
        variant not in RUNNABLE, reason=f"this CPU lacks {', '.join(lacks) or 'x86'}: {variant} not run here"))


VARIANTS = [runs_here(v) for v in native_op.VARIANTS]


@functools.cache
def kernel(variant: str):
    return native_op.gguf_matmul(4, variant=variant)  # more threads than this machine's cores: the split and its races


def weights(kind, rows: int, columns: int, seed: int) -> np.ndarray:
    from gguf_support import _values

    rng = np.random.default_rng(seed)
    w = _values(rng, (rows, columns), kind, norm=False)
    return np.ascontiguousarray(w.astype(np.float32) if kind == T.F32 else w)


def float_weights(kind, rows: int, columns: int, seed: int) -> np.ndarray:
    values = (np.random.default_rng(seed).standard_normal((rows, columns)) * 0.1).astype(np.float32)
    if kind == T.F16:
        return values.astype(np.float16).view(np.uint8)
    if kind == T.BF16:
        return np.ascontiguousarray((values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8))
    return values


def matmul(variant: str, x: np.ndarray, w: np.ndarray, kind, n: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.full((x.shape[0], n), np.nan, dtype=np.float32)
    assert kernel(variant)(x.ctypes.data, w.ctypes.data, y.ctypes.data, x.shape[0], x.shape[1], n, int(kind)) == 0
    return y


def activations(rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    x[0, :40] = 0.0  # a zero block (scale 0)
    x[-1, 3] = 50.0  # one large value in a block: ties and +-127
    return x


def int8_activations(x: np.ndarray, block: int) -> np.ndarray:
    """x as the kernels quantize it: int8 per block of `block`, scale max|x| / 127, back to float."""
    blocks = x.reshape(x.shape[0], -1, block)
    d = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.clip(np.rint(blocks * inverse), -127, 127) * d).reshape(x.shape)


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("variant", VARIANTS)
def test_products_are_exact_for_their_int8_activations(variant, kind):
    """Every block type's product equals the dequantized weights times the int8 activations (float rounding)."""
    from gguf.quants import dequantize

    w = weights(kind, 40, 768, int(kind))
    x = activations(11, 768, int(kind))
    block = 256 if kind in (T.Q4_K, T.Q5_K, T.Q6_K) else 32
    expected = int8_activations(x, block).astype(np.float64) @ dequantize(w, kind).reshape(40, 768).T
    assert np.abs(matmul(variant, x, w, kind, 40) - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("kind", FLOAT_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("variant", VARIANTS)
def test_float_rows_multiply_float_activations(variant, kind):
    w = float_weights(kind, 24, 200, 3)  # 200: 12 lanes of 16, then a tail of 8
    x = activations(5, 200, 3)
    values = {T.F32: lambda a: a, T.F16: lambda a: a.view(np.float16).astype(np.float32),
              T.BF16: lambda a: (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)}[kind](w)
    expected = x.astype(np.float64) @ values.reshape(24, 200).T.astype(np.float64)
    assert np.abs(matmul(variant, x, w, kind, 24) - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("kind", BLOCK_TYPES + FLOAT_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_computes_alike_alone_and_in_any_tile(variant, kind):
    """Rows of one call give the bits each gives alone: 19 rows (tiles of 8 and a tail of 3), 5 rows, and the
    rows one by one; enough weight rows for several chunks and threads."""
    k = 512
    w = float_weights(kind, 700, k, 1) if kind in FLOAT_TYPES else weights(kind, 700, k, 1)
    x = activations(19, k, 2)
    together = matmul(variant, x, w, kind, 700)
    assert np.array_equal(matmul(variant, x[7:12], w, kind, 700), together[7:12])
    for i in (0, 3, 8, 15, 18):
        assert np.array_equal(matmul(variant, x[i:i + 1], w, kind, 700)[0], together[i]), i


@pytest.mark.parametrize("kind", BLOCK_TYPES + FLOAT_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.values[0] != "portable"])
def test_a_variant_gives_the_portable_bits(variant, kind):
    """The AVX2 kernels follow the portable arithmetic: the same bits; AVX-512 VNNI: within TOLERANCE."""
    k = 1024
    w = float_weights(kind, 96, k, 4) if kind in FLOAT_TYPES else weights(kind, 96, k, 4)
    x = activations(13, k, 5)
    reference, got = matmul("portable", x, w, kind, 96), matmul(variant, x, w, kind, 96)
    if portable_bits(variant, kind):
        assert np.array_equal(got, reference)
    else:
        assert np.abs(got - reference).max() <= TOLERANCE * np.abs(reference).max()


EXACT_PAIRS = [pytest.param(v.values[0], kind, marks=v.marks, id=f"{v.values[0]}-{kind.name}") for v in VARIANTS
               for kind in BLOCK_TYPES if v.values[0] != "portable" and portable_bits(v.values[0], kind)]


@pytest.mark.parametrize("k", [768, 4096])  # 8 rows in a tile (levels in L1), and the per-row kernels (over 28 KB)
@pytest.mark.parametrize(("variant", "kind"), EXACT_PAIRS)
def test_every_tile_size_gives_the_portable_bits(variant, kind, k):
    """Calls of 1..9 rows (every tile size the kernels are built for, a full tile and one row more): each row the
    portable kernels' bits, with odd numbers of weight rows."""
    w = weights(kind, 37, k, 6)
    x = activations(9, k, 7)
    reference = matmul("portable", x, w, kind, 37)
    for rows in range(1, 10):
        assert np.array_equal(matmul(variant, x[9 - rows:], w, kind, 37), reference[9 - rows:]), rows


@pytest.mark.parametrize("k", [768, 4096])
@pytest.mark.parametrize("kind", AMX_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("variant", ["avx2", "avx512-vnni", "avx512-amx"])
def test_many_rows_give_the_portable_bits_at_any_number_of_rows(variant, kind, k):
    """From 12 rows, the lane kernels (avx2: 8 activation rows a vector, avx512-vnni: 16), from 9 the AMX tiles (16 x
    16), a part tile past each multiple of 8 or 16, against 16 weight rows (37: a part tile); below, the 8-row
    kernels: every row the portable bits, so a row computes alike alone and in a batch of any size."""
    if variant not in RUNNABLE:
        lacks = sorted(set(native_op.VARIANTS[variant][1]) - native_op.cpu_flags())
        pytest.skip(f"this CPU lacks {', '.join(lacks) or 'x86'}: the {variant} kernels not run here")
    if variant == "avx512-amx" and not native_op.amx_tiles(variant):  # a kernel before Linux 5.16, or a hypervisor
        pytest.skip("the OS refused AMX tiles (arch_prctl(ARCH_REQ_XCOMP_PERM)): the tiles not run here")
    w = weights(kind, 37, k, 8)
    x = activations(81, k, 9)
    reference = matmul("portable", x, w, kind, 37)
    for rows in (1, 2, 5, 7, 8, 9, 15, 16, 17, 32, 33, 64, 65, 81):
        assert np.array_equal(matmul(variant, x[81 - rows:], w, kind, 37), reference[81 - rows:]), rows


@functools.cache
def prepared_kernel(variant: str):
    return native_op.gguf_prepared(4, variant=variant)


@pytest.mark.parametrize("k", [768, 4096])
@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_repacked_once_give_the_portable_bits_at_any_number_of_rows(variant, kind, k):
    """What the ONNX Runtime op multiplies by: the weights repacked once (the AVX-512 variants: Q4_K, Q5_K, Q6_K, Q4_0,
    Q4_1 and Q8_0 in blocks of 16 weight rows, the rows in lanes; Q4_K and Q6_K on AMX tiles from 16 or 32 rows), else
    as they lie: every row the portable bits (Q5_0, Q5_1: the portable kernels themselves), 37 weight rows (a part
    block of 16), rows 1-81; the 32-value types also at k - 128 (k 640: 20 blocks; 3968: not a multiple of 256)."""
    prepare, product, release = prepared_kernel(variant)
    for width in (k, k - 128) if kind not in (T.Q4_K, T.Q5_K, T.Q6_K) else (k,):
        w = weights(kind, 37, width, 10)
        x = activations(81, width, 11)
        reference = matmul("portable", x, w, kind, 37)
        handle = prepare(w.ctypes.data, width, 37, int(kind))
        assert (handle is not None) == (variant.startswith("avx512") and kind in REPACKED_TYPES), width
        try:
            for rows in (1, 2, 5, 8, 9, 16, 17, 33, 81):
                y = np.full((rows, 37), np.nan, dtype=np.float32)
                xs = np.ascontiguousarray(x[81 - rows:])
                assert product(handle, xs.ctypes.data, w.ctypes.data, y.ctypes.data, rows, width, 37, int(kind)) == 0
                if portable_bits(variant, kind) or handle is not None:
                    assert np.array_equal(y, reference[81 - rows:]), (width, rows)
                else:
                    assert np.abs(y - reference[81 - rows:]).max() <= TOLERANCE * np.abs(reference).max(), (width, rows)
        finally:
            release(handle)


def test_only_amx_variants_use_tiles():
    for variant in RUNNABLE:
        if variant != "avx512-amx":
            assert not native_op.amx_tiles(variant), variant


@functools.cache
def compiler_takes(flags: tuple) -> bool:
    cxx = native_op.compiler()
    done = subprocess.run([*cxx, *flags, "-x", "c++", "-E", "-", "-o", "/dev/null"], input="", capture_output=True,
                          text=True)
    return done.returncode == 0


@pytest.mark.parametrize("variant", list(native_op.VARIANTS))
def test_every_variant_compiles(variant, tmp_path):
    """Each variant builds, whether or not this CPU runs it (a variant it lacks is built, never loaded)."""
    flags = tuple(native_op.VARIANTS[variant][0])
    if not compiler_takes(flags):
        pytest.skip(f"the compiler does not take {variant}'s flags {' '.join(flags)}")
    path = native_op.library(variant=variant)
    assert path.is_file() and variant in path.parent.name


def test_the_best_variant_the_cpu_runs_is_chosen_unless_one_is_forced(monkeypatch):
    monkeypatch.delenv(native_op.VARIANT_ENV, raising=False)
    assert native_op.chosen_variant() == RUNNABLE[0]
    monkeypatch.setenv(native_op.VARIANT_ENV, "portable")
    assert native_op.chosen_variant() == "portable"
    assert "portable-" in native_op.library().parent.name
    monkeypatch.setenv(native_op.VARIANT_ENV, "sse9")
    with pytest.raises(native_op.NativeOpUnavailable, match="MIRROR_RT_CPU_VARIANT=sse9: not a CPU variant"):
        native_op.chosen_variant()


def test_a_variant_the_cpu_lacks_is_refused(monkeypatch):
    """Never loaded where the CPU lacks its instructions (llama.cpp's AMX build dies with SIGILL on such CPUs)."""
    monkeypatch.setattr(native_op, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma", "f16c"}))
    monkeypatch.setattr(native_op, "_X86", True)
    monkeypatch.setenv(native_op.VARIANT_ENV, "avx512-vnni")
    with pytest.raises(native_op.NativeOpUnavailable, match="this CPU lacks avx512_vnni, avx512bw, avx512dq, "):
        native_op.library()
    monkeypatch.delenv(native_op.VARIANT_ENV)
    assert native_op.chosen_variant() == "avx2"
    monkeypatch.setattr(native_op, "cpu_flags", lambda: frozenset({"sse2"}))
    assert native_op.chosen_variant() == "portable"


@pytest.mark.parametrize("kind", (T.Q4_K, T.Q6_K), ids=lambda kind: kind.name)
def test_the_kernel_bench_times_real_weight_blocks(kind):
    """evaluation.gguf_kernel_bench's random blocks are weights the kernels take (scales set, products finite and
    equal to the dequantized weights' through its own call), so its timings are of the real arithmetic."""
    from gguf.quants import dequantize

    from mirror_rt.evaluation import gguf_kernel_bench

    w = gguf_kernel_bench.random_blocks(int(kind), 24, 512, np.random.default_rng(3))
    x = activations(3, 512, 9)
    y = np.full((3, 24), np.nan, dtype=np.float32)
    assert gguf_kernel_bench.best_ms(native_op.gguf_matmul(4), x, w, y, int(kind), repeats=1) > 0
    expected = int8_activations(x, 256).astype(np.float64) @ dequantize(w, kind).reshape(24, 512).T
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()
