"""The native ops' worker pool (exporters/worker_pool.inc) under stress: tests/native/worker_pool_stress.cpp, built
here with the C++ compiler, runs many back-to-back `parallel()` calls with few indices on more helpers than cores,
from two callers at once (each thread has its own pool), and checks that every index runs exactly once, before
its call returns, that no helper touches a call after it returned, and that helpers follow their caller's cores.
A ThreadSanitizer build of the same harness reports any data race (deterministic where the plain run is not)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HARNESS = Path(__file__).parent / "native" / "worker_pool_stress.cpp"
EXPORTERS = Path(__file__).parent.parent / "exporters"


def cxx() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


pytestmark = pytest.mark.skipif(cxx() is None, reason="no C++ compiler (set $CXX, or install g++) to build the pool")


def build(folder: Path, *flags: str) -> tuple[Path | None, str]:
    binary = folder / "stress"
    done = subprocess.run([cxx(), "-std=c++17", "-pthread", *flags, "-I", str(EXPORTERS), str(HARNESS), "-o",
                           str(binary)], capture_output=True, text=True, timeout=300)
    return (binary if done.returncode == 0 else None), done.stderr


def stress(binary: Path, calls: int, widest: int, callers: int, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), str(calls), str(widest), str(callers)], capture_output=True, text=True,
                          timeout=600, env=os.environ | env)


def test_every_index_once_and_never_after_return(tmp_path):
    binary, errors = build(tmp_path, "-O2", "-Wall", "-Wextra", "-Werror")
    assert binary is not None, errors
    for widest in (4, 8):
        done = stress(binary, 10000, widest, 2)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "twice 0, missing 0, late 0, twice by the end 0, helpers off their caller's cores 0" in done.stdout


def test_no_data_race_under_thread_sanitizer(tmp_path):
    binary, errors = build(tmp_path, "-O1", "-g", "-fsanitize=thread")
    if binary is None:
        pytest.skip(f"no ThreadSanitizer build here: {(errors.strip().splitlines() or ['?'])[-1]}")
    done = stress(binary, 1500, 6, 2, TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    if "FATAL: ThreadSanitizer" in done.stderr:  # e.g. a kernel's memory layout it cannot run under
        pytest.skip(f"ThreadSanitizer cannot run here: {done.stderr.strip().splitlines()[0]}")
    assert "WARNING: ThreadSanitizer" not in done.stderr, done.stderr[:4000]
    assert done.returncode == 0, done.stdout + done.stderr[:4000]


def test_a_pinned_caller_splits_over_its_own_cores_whatever_else_runs():
    """The ops' thread rule (pool_attention.cpp split_threads): an unpinned caller shares the process's threads
    with the unpinned calls running; a caller pinned to fewer cores (Mirror's target, its draft) takes its cores'
    count however many calls run; a session's own limit caps both."""
    import ctypes

    from mirror_rt.exporters import native_op

    if not native_op.available():
        pytest.skip("no C++ compiler to build the ops")
    lib = ctypes.CDLL(str(native_op.library()))
    split = lib.mirror_rt_ops_split_threads
    cores = sorted(os.sched_getaffinity(0))
    n = len(cores)
    try:
        lib.mirror_rt_ops_call_threads(0)  # no session cap on this thread (an earlier test's session may have set one)
        lib.mirror_rt_ops_threads(n)  # the widest session: every core of this process
        assert [split(1), split(2), split(n + 1)] == [n, max(1, n // 2), 1]
        lib.mirror_rt_ops_threads(4 * n)  # a wider session than these cores: this caller counts as pinned
        assert split(8 * n) == n
        os.sched_setaffinity(0, cores[:1])  # this thread only, as Mirror pins its draft
        assert [split(1), split(8 * n)] == [1, 1]
        os.sched_setaffinity(0, cores)
        lib.mirror_rt_ops_call_threads(1)  # its session asked for one thread
        assert split(1) == 1
    finally:
        os.sched_setaffinity(0, cores)
        lib.mirror_rt_ops_call_threads(0)
        lib.mirror_rt_ops_threads(n)
