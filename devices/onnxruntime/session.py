"""ONNX Runtime sessions whose optimized graphs (weights prepacked) are cached in `<bundle>/.cache/ort/<graph>-<key>/`,
so a later load skips optimizing. The key covers what the optimized graph depends on (onnxruntime's version, the
providers, the optimization level, this CPU, the source file's name, size and mtime); a read-only bundle is not cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

from mirror_rt.exporters.native_op import DOMAIN, cpu_fingerprint
from mirror_rt.exporters.paths import sweep_partials

CACHE_FORMAT = 2  # bump when what is saved changes (2: with the prepacked weights)
GRAPH_FILE, WEIGHTS_FILE = "model.onnx", "model.onnx.data"
# the weights as the CPU kernels repack them at session creation (most of its time), saved and read back as they are
SAVE_PREPACKED = "session.save_external_prepacked_constant_initializers"
# graphs whose weights lie in the bundle's weights.bin are read where they lie: a cached copy would only double them
MAPPED_WEIGHTS = "weights.bin"
# how ONNX Runtime says an allocation failed (a thread's stack or an arena refused: pthread_create's ENOMEM)
ALLOCATION_FAILED = ("bad_alloc", "Failed to allocate memory", "Cannot allocate memory", "error code: 12")


def cache_folder(path: Path, providers: list[str], options) -> Path:
    """Where the optimized form of graph `path` for these providers and options is cached."""
    import onnxruntime as ort

    stat = path.stat()
    key = json.dumps([CACHE_FORMAT, ort.__version__, providers, str(options.graph_optimization_level),
                      cpu_fingerprint(), path.name, stat.st_size, stat.st_mtime_ns])
    return path.parent / ".cache" / "ort" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


GGUF_DRAFT_FORMAT = 3  # bump when what the rewrites below write changes (2: the 8-bit head; 3: the attention)
AS_EXPORTED = "as-exported"  # in a gguf_draft folder: the rewrites found nothing, so the exported graph runs


def gguf_draft(path: Path) -> Path:
    """The graph a CPU session of the q4_1 draft `path` runs: rewritten onto mirror-rt's ops where they build here,
    each rewrite where it pays: its q4_1 products (exporters.q4_min.as_gguf_q4_1) and its 8-bit head
    (exporters.native_rewrites.as_gguf_q8_0) onto MatMulGGUF where this CPU's kernels repack those types (16 weight
    rows an operation: the default draft's forward ~20% cheaper than on MatMulNBits, its head 1.5-3x), its attention
    onto PoolAttention (as_pool_attention: ONNX Runtime's GroupQueryAttention cost 0.1-0.23 ms a layer at 1-4 rows);
    written once into `<bundle>/.cache/gguf/<graph>-<key>/` with its weights in weights.bin (mapped, and repacked
    where they lie); else `path` as exported (no C++ compiler, a read-only bundle, a graph with nothing to rewrite).
    NPUs, GPUs and OpenVINO run the exported graph."""
    from mirror_rt.exporters.native_op import available, repacks
    from mirror_rt.exporters.native_rewrites import Q8_0_TYPE, as_gguf_q8_0, as_pool_attention
    from mirror_rt.exporters.q4_min import Q4_1_TYPE, as_gguf_q4_1

    if not available():
        return path
    rewrites = [rewrite for kind, rewrite in ((Q4_1_TYPE, as_gguf_q4_1), (Q8_0_TYPE, as_gguf_q8_0)) if repacks(kind)]
    rewrites.append(as_pool_attention)
    stat = path.stat()
    key = json.dumps([GGUF_DRAFT_FORMAT, [r.__name__ for r in rewrites], path.name, stat.st_size, stat.st_mtime_ns])
    folder = path.parent / ".cache" / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (folder / GRAPH_FILE).is_file():
        return folder / GRAPH_FILE
    if (folder / AS_EXPORTED).is_file():  # looked at once already: nothing to rewrite (no second read of the graph)
        return path
    partial = _partial_folder(folder)
    if partial is None:
        return path
    import onnx

    model = onnx.load(str(path))
    try:
        if sum([rewrite(model) for rewrite in rewrites]):  # (each rewrite runs)
            onnx.save_model(model, str(partial / GRAPH_FILE), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=MAPPED_WEIGHTS, size_threshold=1024)
        else:
            (partial / AS_EXPORTED).touch()
    except OSError:  # a full disk: the graph as exported
        shutil.rmtree(partial, ignore_errors=True)
        return path
    _publish(partial, folder)
    return folder / GRAPH_FILE if (folder / GRAPH_FILE).is_file() else path


def create_session(path: Path, providers: list[str], make_options):
    """An InferenceSession over `path` (`make_options()`: fresh SessionOptions); BundleError saying why where the graph
    has mirror-rt's ops and they cannot be used here."""
    try:
        return _create_session(path, providers, make_options)
    except Exception as exc:
        if allocation_failed(exc):  # ONNX Runtime's std::bad_alloc (an address-space limit, a full machine)
            from mirror_rt.models.memory import out_of_memory

            raise out_of_memory(f"creating ONNX Runtime's session of {path}") from None
        if f"{DOMAIN}:" not in str(exc) or "not a registered function/op" not in str(exc):
            raise
        from mirror_rt.exporters.manifest import BundleError
        from mirror_rt.exporters.native_op import NativeOpUnavailable, library

        try:
            library()
            reason = "ONNX Runtime did not take it"
        except NativeOpUnavailable as unavailable:
            reason = str(unavailable)
        instead = ("run its model in torch eager with --torch (a GGUF file's or a large folder's bundle has no "
                   "standard-op form)" if (Path(path).parent / MAPPED_WEIGHTS).is_file()
                   else "export the bundle here with --attention standard")
        raise BundleError(f"{path} runs on mirror-rt's own ONNX Runtime ops, which this machine cannot use "
                          f"({reason}); {instead}") from None


def allocation_failed(exc: BaseException) -> bool:
    """Whether `exc` is ONNX Runtime failing to allocate: its Fail / RuntimeException ending in std::bad_alloc, or a
    thread it could not start (pybind11 gives MemoryError only where the allocation escapes ONNX Runtime's catch)."""
    text = str(exc)
    return isinstance(exc, MemoryError) or any(sign in text for sign in ALLOCATION_FAILED)


def _create_session(path: Path, providers: list[str], make_options):
    import onnxruntime as ort

    options = make_options()
    if (Path(path).parent / MAPPED_WEIGHTS).is_file():  # weights read where they lie: nothing to save
        return ort.InferenceSession(str(path), options, providers=providers)
    folder = cache_folder(Path(path), providers, options)
    if (folder / GRAPH_FILE).is_file():
        cached = make_options()
        cached.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # optimized already
        try:
            return ort.InferenceSession(str(folder / GRAPH_FILE), cached, providers=providers)
        except Exception:  # damaged from outside (a full disk, a cut copy): built again below, the cache replaced
            shutil.rmtree(folder, ignore_errors=True)
    partial = _partial_folder(folder)
    if partial is not None:
        options.optimized_model_filepath = str(partial / GRAPH_FILE)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", WEIGHTS_FILE)
        options.add_session_config_entry(SAVE_PREPACKED, "1")
        options.log_severity_level = 3  # its warning that the saved graph is hardware specific: the key holds the CPU
    session = ort.InferenceSession(str(path), options, providers=providers)
    if partial is not None:
        _publish(partial, folder)
    return session


def _partial_folder(folder: Path) -> Path | None:
    """A fresh folder of this thread to save into, or None where the bundle cannot be written."""
    sweep_partials(folder)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}-{threading.get_ident()}")
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only bundle: sessions are built as without a cache
        return None
    return partial


def _publish(partial: Path, folder: Path) -> None:
    """Rename the saved folder into place (atomic); another process or thread that was first keeps its own."""
    try:
        if (partial / GRAPH_FILE).is_file() or (partial / AS_EXPORTED).is_file():
            partial.rename(folder)
    except OSError:  # `folder` exists: someone published the same graph first
        pass
    shutil.rmtree(partial, ignore_errors=True)
