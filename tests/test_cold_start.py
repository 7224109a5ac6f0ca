"""A cold `mirror-rt run` over an ONNX bundle imports neither torch nor transformers (nor OpenVINO).

Importing torch took about a second of the default run's three; the bundle path decodes numpy arrays
(runtime.transfer). Each check runs the CLI in a fresh interpreter and lists what it imported.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "openvino")
RUN = ("import sys; from mirror_rt.cli import main; rc = main(sys.argv[1:]); "
       f"print(sorted(m for m in {HEAVY!r} if m in sys.modules), rc)")


def _imported_by_run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-c", RUN, "run", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_cli_import_is_light():
    code = f"import sys, mirror_rt.cli; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_run_of_an_onnx_bundle_imports_no_torch(tmp_path):
    """Greedy decoding of a tiny exported bundle (ONNX Runtime, shared KV), in every mode."""
    pytest.importorskip("onnxruntime")
    from mirror_rt.exporters.export import export_bundle

    folder = export_bundle("tiny", tmp_path / "bundle", progress=False)
    for mode in ("mirror", "sd", "ar"):
        assert _imported_by_run("hello", "--bundle", str(folder), "--mode", mode, "--max-new-tokens", "6",
                                "--no-chat") == "[] 0"


@pytest.mark.slow
def test_run_of_the_default_bundle_imports_no_torch(cache_dir):
    """`mirror-rt run` on the cached default bundle: no torch, no transformers, no OpenVINO."""
    from mirror_rt.devices.engines import default_bundle

    default_bundle(cache_dir, progress=False)  # exported here (with torch) when the cache has none yet
    assert _imported_by_run("What is the capital of France?", "--max-new-tokens", "8",
                            "--cache-dir", cache_dir) == "[] 0"


def test_torch_threads_asked_before_torch_is_imported_apply_when_it_is():
    """A worker's thread count (WorkerBudget.apply) waits for torch's import: sampled draws on host arrays then
    compute with the threads they always had."""
    code = ("import sys; from mirror_rt.runtime import transfer; transfer.set_threads(1); "
            "assert 'torch' not in sys.modules; print(transfer.import_torch().get_num_threads())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
