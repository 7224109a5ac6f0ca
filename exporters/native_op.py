"""mirror-rt's own ONNX Runtime op, built once per machine: `mirror_rt.PoolAttention` (exporters/pool_attention.cpp).

The source ships with the package; the first load compiles it (`$CXX`, else g++ or c++, -march=native) into
`<cache>/native/<key>/` (sources, compiler, CPU), published atomically. Without a compiler `library()` says why in
one line and exports fall back to the standard-op graphs.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

from mirror_rt.models.default_model import cache_dir
from mirror_rt.models.partials import partial_folder, sweep_partials

SOURCES = ("pool_attention.cpp", "native_numbers.inc", "quantize_rows.inc", "pool_attention_ort.inc", "gguf_blocks.inc",
           "gguf_matmul.inc", "worker_pool.inc")
LIBRARY = "libmirror_rt_ops.so"
DOMAIN = "mirror_rt"  # the op's ONNX domain
OP = "PoolAttention"
OP_HALF = "PoolAttentionHalf"  # the same over float16 keys and values (ExportConfig.kv_dtype fp16)
QUANTIZE_ROWS = "QuantizeRows"  # exporters.w8a8's activations per row, in one node
ATTENTION = "attention"  # model metadata of graphs with the op: "pool" (the backend's sign that rows attend apart)
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread"]

_lock = threading.Lock()
_built: dict = {}  # cache folder -> (path or None, reason)


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


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else g++, else c++; None when there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _key(cxx: str) -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((here / name).read_bytes())
    digest.update(" ".join([cxx, *FLAGS, cpu_fingerprint()]).encode())
    return digest.hexdigest()[:16]


def library(cache: str | os.PathLike | None = None) -> Path:
    """The built library (building it on first use); raises NativeOpUnavailable with the reason."""
    cxx = compiler()
    if cxx is None:
        raise NativeOpUnavailable("no C++ compiler (set $CXX, or install g++) to build mirror-rt's attention op")
    folder = cache_dir(cache) / "native" / _key(cxx)
    with _lock:
        if folder not in _built:
            _built[folder] = _build(cxx, folder)
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


def _build(cxx: str, folder: Path) -> tuple[Path | None, str]:
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
        return None, f"cannot build mirror-rt's attention op in {folder.parent}: {exc.strerror or exc}"
    try:
        command = [cxx, *FLAGS, "-I", str(here), str(here / SOURCES[0]), "-o", str(staging / LIBRARY)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            return None, f"building mirror-rt's attention op failed: {(lines or ['no output'])[0].strip()}"
        try:
            staging.rename(folder)
        except OSError:  # another process published it first
            if not target.is_file():
                raise
        return target, ""
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"building mirror-rt's attention op failed: {exc}"
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
