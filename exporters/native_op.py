"""mirror-rt's own ONNX Runtime ops (exporters/pool_attention.cpp: attention, GGUF products), built once per machine.

The sources ship with the package; the first load compiles them (`$CXX`, else g++ or c++) into
`<cache>/native/<variant>-<key>/` (key: sources, compiler, flags, CPU), published atomically. One library per CPU
variant (VARIANTS: portable, avx2, avx512-vnni, avx512-amx), each built with its own instruction-set flags, never
-march=native: the best one this CPU runs is chosen at load (`/proc/cpuinfo`'s flags), and only the variants used
are built. MIRROR_RT_CPU_VARIANT=<name> forces one (tests, benchmarks); a variant the CPU lacks is refused (its code
would die with SIGILL). Without a compiler `library()` says what to install in one line; the traced exporter
(folders under 1 GB) then falls back to the standard-op graphs, while GGUF files and folders over 1 GB, whose every
product is this library's MatMulGGUF, are refused before export (exporters.stream_export).
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from mirror_rt.models.default_model import cache_dir
from mirror_rt.models.partials import partial_folder, sweep_partials

SOURCES = ("pool_attention.cpp", "native_numbers.inc", "quantize_rows.inc", "pool_attention_ort.inc", "gguf_blocks.inc",
           "gguf_matmul.inc", "gguf_avx2.inc", "gguf_vnni.inc", "gguf_lanes.inc", "gguf_amx.inc", "gguf_rows16.inc",
           "worker_pool.inc", "attention_avx2.inc")
LIBRARY = "libmirror_rt_ops.so"
DOMAIN = "mirror_rt"  # the op's ONNX domain
OP = "PoolAttention"
OP_HALF = "PoolAttentionHalf"  # the same over float16 keys and values (ExportConfig.kv_dtype fp16)
QUANTIZE_ROWS = "QuantizeRows"  # exporters.w8a8's activations per row, in one node
ATTENTION = "attention"  # model metadata of graphs with the op: "pool" (the backend's sign that rows attend apart)
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]
VARIANT_ENV = "MIRROR_RT_CPU_VARIANT"
# name: (compiler flags, /proc/cpuinfo flags the CPU needs), best last. The x86 baseline for portable (SSE2): a
# compiler whose default targets more would otherwise build code older CPUs lack. avx512-amx: the AVX-512 VNNI
# variant plus tile products of many rows for Q4_K and Q6_K (gguf_amx.inc).
_X86 = platform.machine().lower() in ("x86_64", "amd64")
_AVX2 = (["-march=x86-64", "-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c"))
_VNNI = (_AVX2[0] + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"],
         _AVX2[1] + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"))
VARIANTS = {
    "portable": (["-march=x86-64", "-mtune=generic"] if _X86 else [], ()),
    "avx2": _AVX2,
    "avx512-vnni": _VNNI,
    "avx512-amx": (_VNNI[0] + ["-mamx-tile", "-mamx-int8"], _VNNI[1] + ("amx_tile", "amx_int8")),
}

_lock = threading.Lock()
_built: dict = {}  # library folder -> (path or None, reason)


class NativeOpUnavailable(RuntimeError):
    """The native op cannot be built here (no compiler, or it failed); the message says why in one line."""


def cpu_fingerprint() -> str:
    """This CPU's model name and feature flags (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


@functools.cache
def cpu_flags() -> frozenset:
    """The instruction-set flags this CPU reports (Linux's /proc/cpuinfo; elsewhere none: the portable variant)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable_variants() -> list[str]:
    """The variants this CPU runs, best first."""
    if not _X86:
        return ["portable"]
    flags = cpu_flags()
    return [name for name, (_, needs) in reversed(VARIANTS.items()) if set(needs) <= flags]


def chosen_variant() -> str:
    """The variant this process loads: $MIRROR_RT_CPU_VARIANT where set (refused where the CPU lacks it), else the
    best one the CPU runs."""
    asked = os.environ.get(VARIANT_ENV, "").strip()
    if not asked:
        return runnable_variants()[0]
    if asked not in VARIANTS:
        raise NativeOpUnavailable(f"{VARIANT_ENV}={asked}: not a CPU variant (take {', '.join(VARIANTS)})")
    if asked not in runnable_variants():
        missing = sorted(set(VARIANTS[asked][1]) - cpu_flags()) or [platform.machine()]
        raise NativeOpUnavailable(f"{VARIANT_ENV}={asked}: this CPU lacks {', '.join(missing)} (it runs "
                                  f"{', '.join(runnable_variants())})")
    return asked


def install_hint() -> str:
    """What to run here to get a C++ compiler."""
    for tool, command in (("apt-get", "apt-get install g++"), ("dnf", "dnf install gcc-c++"),
                          ("yum", "yum install gcc-c++"), ("apk", "apk add g++"), ("pacman", "pacman -S gcc"),
                          ("zypper", "zypper install gcc-c++"), ("brew", "xcode-select --install")):
        if shutil.which(tool):
            return command
    return "install g++ or clang++"


def compiler() -> list[str] | None:
    """The C++ compiler command to build with: $CXX (it may hold words: `ccache g++`), else g++, else c++; None
    when there is none. NativeOpUnavailable when $CXX names no program here (not silently another compiler)."""
    asked = os.environ.get("CXX", "").strip()
    if asked:
        words = shlex.split(asked)
        found = shutil.which(words[0])
        if found is None:
            raise NativeOpUnavailable(f"$CXX={asked}: no such program here (set $CXX to a C++ compiler, or unset it "
                                      f"to use g++; to install one: {install_hint()})")
        return [found, *words[1:]]
    for name in ("g++", "c++"):
        if shutil.which(name):
            return [shutil.which(name)]
    return None


@functools.cache
def _sources_digest() -> bytes:  # read once per process: a library loaded here matches the sources it was keyed by
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in SOURCES)).digest()


def _key(cxx: list[str], variant: str) -> str:
    digest = hashlib.sha256(_sources_digest())
    digest.update(" ".join([*cxx, *FLAGS, *VARIANTS[variant][0], cpu_fingerprint()]).encode())
    return f"{variant}-{digest.hexdigest()[:16]}"


def require() -> None:
    """NativeOpUnavailable, in one line saying what to install, where no compiler is here (GGUF exports call it
    before anything starts: their graphs need the ops)."""
    if compiler() is None:
        raise NativeOpUnavailable(f"no C++ compiler to build mirror-rt's CPU kernels: {install_hint()} (or set "
                                  "$CXX to one)")


def library(cache: str | os.PathLike | None = None, variant: str | None = None) -> Path:
    """The built library of `variant` (None: chosen_variant()), building it on first use; raises
    NativeOpUnavailable with the reason (no compiler, a failed build, a variant this CPU lacks)."""
    variant = variant or chosen_variant()
    if variant not in VARIANTS:
        raise NativeOpUnavailable(f"{variant}: not a CPU variant (take {', '.join(VARIANTS)})")
    require()
    cxx = compiler()
    folder = cache_dir(cache) / "native" / _key(cxx, variant)
    with _lock:
        if folder not in _built:
            _built[folder] = _build(cxx, variant, folder)
    path, reason = _built[folder]
    if path is None:
        raise NativeOpUnavailable(reason)
    return path


def available(cache: str | os.PathLike | None = None) -> bool:
    """Whether the native op is built or can be."""
    try:
        library(cache)
        return True
    except NativeOpUnavailable:
        return False


def _build(cxx: list[str], variant: str, folder: Path) -> tuple[Path | None, str]:
    target = folder / LIBRARY
    if target.is_file():
        return target, ""
    here = Path(__file__).parent
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        sweep_partials(folder)  # what a killed build left
        staging = Path(f"{partial_folder(folder)}-{threading.get_ident()}")
        staging.mkdir()
    except OSError as exc:
        return None, f"cannot build mirror-rt's CPU kernels in {folder.parent}: {exc.strerror or exc}"
    print(f"compiling mirror-rt's CPU kernels ({variant}), ~1 min, once", file=sys.stderr, flush=True)
    try:
        command = [*cxx, *FLAGS, *VARIANTS[variant][0], "-I", str(here), str(here / SOURCES[0]), "-o",
                   str(staging / LIBRARY)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            return None, f"building mirror-rt's CPU kernels ({variant}) failed: {(lines or ['no output'])[0].strip()}"
        try:
            staging.rename(folder)
        except OSError:  # another process published it first
            if not target.is_file():
                raise
        return target, ""
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"building mirror-rt's CPU kernels ({variant}) failed: {exc}"
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def call_threads(threads: int | None) -> None:
    """The threads the ops may use in calls made from this thread (its session's intra-op threads; None: no
    limit beyond the process's), where the library is built here."""
    function = _call_threads()
    if function is not None:
        function(int(threads or 0))


@functools.cache
def _call_threads():
    import ctypes

    try:
        return ctypes.CDLL(str(library())).mirror_rt_ops_call_threads
    except NativeOpUnavailable:
        return None


def set_threads(threads: int) -> None:
    """Threads the op's calls of this process may use together (a long prompt's attention splits over them; calls
    running at once share them)."""
    import ctypes

    ctypes.CDLL(str(library())).mirror_rt_ops_threads(int(threads))


def amx_tiles(variant: str | None = None) -> bool:
    """Whether `variant`'s build (else this CPU's) multiplies many rows on AMX tiles here: an AMX variant, and the
    OS granted the tiles (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM), asked at the first product)."""
    import ctypes

    return bool(ctypes.CDLL(str(library(variant=variant))).mirror_rt_gguf_amx())


def repacks(kind: int, variant: str | None = None) -> bool:
    """Whether `variant`'s build (else this CPU's) multiplies GGUF `kind` weights repacked once into blocks of 16
    weight rows (the AVX-512 variants: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K); False where no library builds here."""
    import ctypes

    try:
        return bool(ctypes.CDLL(str(library(variant=variant))).mirror_rt_gguf_repacks(int(kind)))
    except NativeOpUnavailable:
        return False


def gguf_matmul(threads: int, path: str | os.PathLike | None = None, variant: str | None = None):
    """The library's MatMulGGUF product as a C function (the library at `path`, else `variant`'s build, else this
    CPU's), its calls allowed `threads` threads: f(x, w, y, rows, k, n, type) -> 0, over the addresses of float32
    x [rows, k], the GGUF blocks w [n, k's bytes] and float32 y [rows, n] (the kernel tests, gguf_kernel_bench)."""
    import ctypes

    lib = ctypes.CDLL(str(path or library(variant=variant)))
    lib.mirror_rt_gguf_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.mirror_rt_ops_threads(int(threads))
    return lib.mirror_rt_gguf_matmul


def gguf_prepared(threads: int, path: str | os.PathLike | None = None, variant: str | None = None):
    """The library's MatMulGGUF over weights repacked once (what its ONNX Runtime op does with a bundle's weights):
    (prepare, product, release) as C functions: prepare(w, k, n, type) -> a handle, or None where the variant reads
    such weights as they lie; product(handle, x, w, y, rows, k, n, type) -> 0, the same bits as `gguf_matmul`'s;
    release(handle)."""
    import ctypes

    lib = ctypes.CDLL(str(path or library(variant=variant)))
    lib.mirror_rt_gguf_prepare.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.mirror_rt_gguf_prepare.restype = ctypes.c_void_p
    lib.mirror_rt_gguf_matmul_prepared.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.mirror_rt_gguf_release.argtypes = [ctypes.c_void_p]
    lib.mirror_rt_ops_threads(int(threads))
    return lib.mirror_rt_gguf_prepare, lib.mirror_rt_gguf_matmul_prepared, lib.mirror_rt_gguf_release


def register(options, threads: int | None = None) -> None:
    """The ops into ONNX Runtime SessionOptions `options`, where they build here (a graph that needs them and
    finds none fails at load: devices.onnxruntime.session says why). Their calls may use as many threads together as the
    widest session of this process asks for (`threads`; None: every core this process may run on)."""
    try:
        path = library()
    except NativeOpUnavailable:
        return
    options.register_custom_ops_library(str(path))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _widest[0] = max(_widest[0], int(threads or cores))
    set_threads(_widest[0])


_widest = [1]  # the most threads a session of this process was given
