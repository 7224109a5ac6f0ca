"""A bundle loaded under an address-space limit (`prlimit --as`, `ulimit -v`) that cannot hold it: one line, exit 1,
no traceback. Under `prlimit --as` of 1.2x or 2x the 7B file, `run` printed a 53-line traceback ending in ONNX
Runtime's std::bad_alloc (mirror) or aborted with Rust's "memory allocation of 11 bytes failed", exit 134 (ar):
the address space a bundle needs is now checked before any session or the tokenizer is made, and ONNX Runtime's
own allocation failures are caught into one line. At small scale: a tiny GGUF bundle (tests/gguf_support.py), the
console script `mirror-rt` under `prlimit --as` just above what Python and the imports take."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from gguf_support import default_gguf, write_gguf

pytestmark = pytest.mark.slow
PRLIMIT = shutil.which("prlimit")


def console(*args, env, limit: int | None = None) -> subprocess.CompletedProcess:
    script = shutil.which("mirror-rt")
    command = [script] if script else [sys.executable, "-m", "mirror_rt.cli"]
    prefix = [PRLIMIT, f"--as={limit}"] if limit else []
    return subprocess.run([*prefix, *command, *args], capture_output=True, text=True, timeout=600, env=env)


def imports_take() -> int:
    """Address space a fresh Python takes with the CLI and ONNX Runtime imported (VmSize, bytes)."""
    code = ("import mirror_rt.cli.dispatch, onnxruntime\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmSize')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out) * 1024


@pytest.fixture(scope="module")
def exported(tmp_path_factory, cache_dir):
    """A tiny GGUF, exported into its own cache by a first run without a limit."""
    folder = tmp_path_factory.mktemp("as")
    model = write_gguf(folder / "tiny.gguf", default_gguf(cache_dir), "qwen2")
    env = dict(os.environ, MIRROR_RT_CACHE=str(folder / "cache"))
    first = console("run", "--model", str(model), "--max-new-tokens", "2", "--mode", "ar", "hi", env=env)
    assert first.returncode == 0, first.stderr
    return model, env


@pytest.mark.skipif(PRLIMIT is None or not sys.platform.startswith("linux"), reason="needs Linux's prlimit")
@pytest.mark.parametrize("mode", ["ar", "mirror"])
def test_a_limit_below_what_the_bundle_maps_is_one_line(exported, mode):
    model, env = exported
    limit = imports_take() + (128 << 20)  # the imports fit; the sessions and their threads do not
    proc = console("run", "--model", str(model), "--max-new-tokens", "2", "--mode", mode, "hi", env=env, limit=limit)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("mirror-rt: error: out of memory: loading "), proc.stderr[-2000:]
    assert "address-space limit (ulimit -v) leaves" in lines[0] and "raise it by" in lines[0]
    assert "Traceback" not in proc.stderr and "bad_alloc" not in proc.stderr


def test_onnx_runtime_s_own_allocation_failure_is_out_of_memory(exported, monkeypatch):
    """Past the check (a limit it could not foresee), ONNX Runtime's Fail ending in std::bad_alloc, or a thread it
    could not start, is the one-line OutOfMemory the CLI prints, naming the graph."""
    import onnxruntime as ort

    from mirror_rt.devices.onnxruntime.session import create_session
    from mirror_rt.models.memory import OutOfMemory

    model, env = exported
    graph = next((p for p in (model.parent / "cache" / "bundles").rglob("target_prefix.onnx")), None)
    assert graph is not None
    for text in ("[ONNXRuntimeError] : 1 : FAIL : Load model from x failed:std::bad_alloc",
                 "env.cc:327 PosixThread pthread_create failed, error code: 12 error msg: Cannot allocate memory"):
        def refused(*args, text=text, **kwargs):
            raise RuntimeError(text)

        monkeypatch.setattr(ort, "InferenceSession", refused)
        with pytest.raises(OutOfMemory, match=f"out of memory: creating ONNX Runtime's session of {graph}"):
            create_session(graph, ["CPUExecutionProvider"], ort.SessionOptions)
