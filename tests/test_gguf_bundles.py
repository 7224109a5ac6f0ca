"""GGUF files as they lie: the block kernels, bundles written one tensor at a time, and their decoding.

Small GGUFs of each family are written here (tests/gguf_support.py: random weights in the block types of a
Q4_K_M file, the default model's vocabulary); the default model's own GGUF (llama, Q4_1) covers llama.cpp's paired
rotary rows. Full-size runs are benchmarks (README, docs/performance.md), not tests.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf_support import default_gguf, write_gguf
from test_gguf_kernels import int8_activations

pytestmark = pytest.mark.slow  # the default model's GGUF (its vocabulary), fetched once

KERNEL_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)


@pytest.fixture(scope="module")
def vocab_gguf(cache_dir) -> Path:
    return default_gguf(cache_dir)


@pytest.fixture(scope="module")
def qwen2_gguf(vocab_gguf, tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("q2") / "tiny-qwen2.gguf", vocab_gguf, "qwen2")


def _kernel():
    from mirror_rt.exporters.native_op import library

    lib = ctypes.CDLL(str(library()))
    lib.mirror_rt_gguf_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return lib.mirror_rt_gguf_matmul


def _blocks(kind, rows: int, columns: int, rng) -> np.ndarray:
    from gguf_support import _values

    return np.ascontiguousarray(_values(rng, (rows, columns), kind, norm=False))


def _matmul(x: np.ndarray, w: np.ndarray, kind, n: int) -> np.ndarray:
    y = np.zeros((x.shape[0], n), dtype=np.float32)
    assert _kernel()(x.ctypes.data, w.ctypes.data, y.ctypes.data, x.shape[0], x.shape[1], n, int(kind)) == 0
    return y


@pytest.mark.parametrize("kind", KERNEL_TYPES)
def test_products_over_gguf_blocks_are_exact_for_their_int8_activations(kind):
    """Every block type's product equals the dequantized weights times the int8 activations (float rounding)."""
    from gguf.quants import dequantize

    rng = np.random.default_rng(int(kind))
    w = _blocks(kind, 48, 512, rng)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    block = 256 if kind in (T.Q4_K, T.Q5_K, T.Q6_K) else 32
    expected = int8_activations(x, block).astype(np.float64) @ dequantize(w, kind).reshape(48, 512).T
    got = _matmul(x, w, kind, 48)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("kind", (T.Q4_K, T.Q6_K, T.Q8_0, T.F16, T.BF16, T.F32))
def test_a_row_computes_alike_alone_and_among_others(kind):
    """Rows of one call give the bits each gives alone (tiles of 4 rows, tails, threads)."""
    rng = np.random.default_rng(1)
    w = _blocks(kind, 640, 768, rng)
    x = rng.standard_normal((9, 768)).astype(np.float32)
    together = _matmul(x, w, kind, 640)
    alone = np.concatenate([_matmul(x[i:i + 1].copy(), w, kind, 640) for i in range(9)])
    assert np.array_equal(together, alone)


def _export(source: Path, out: Path, **options) -> Path:
    from mirror_rt.exporters.export import export_bundle

    return export_bundle(str(source), out, progress=False, **options)


def _engine(bundle: Path, rows: int = 1):
    from mirror_rt.devices.bundle_engine import load_bundle
    from mirror_rt.devices.options import EngineConfig

    return load_bundle(EngineConfig.from_flags(bundle=str(bundle), max_num_seqs=rows))


def test_a_gguf_bundle_holds_its_graphs_and_the_file_blocks_once(qwen2_gguf, tmp_path, monkeypatch):
    """Four small graphs over one weights.bin holding the GGUF's blocks as they are; only listed files remain. Every
    file has the digest the manifest records (weights.bin's, hashed while written), and the export stamped them
    verified: the first load hashes nothing."""
    from mirror_rt.exporters import manifest as manifests

    bundle = _export(qwen2_gguf, tmp_path / "b")
    hashed, real = [], manifests.sha256_file
    monkeypatch.setattr(manifests, "sha256_file", lambda path: hashed.append(path.name) or real(path))
    manifest = manifests.read_manifest(bundle)
    assert hashed == []
    listed = {name: digest for g in manifest.graphs for name, digest in g.files.items()} | manifest.tokenizer["files"]
    assert {name: real(bundle / name) for name in listed} == listed
    present = {p.name for p in bundle.iterdir() if p.is_file()}
    assert present == set(listed) | {"manifest.json"}
    weights = (bundle / "weights.bin").stat().st_size
    assert weights <= 1.02 * qwen2_gguf.stat().st_size  # the draft shares the target's blocks: stored once
    assert {g.precision for g in manifest.graphs} == {"gguf"}
    assert all((bundle / g.file).stat().st_size < 1 << 20 for g in manifest.graphs)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_greedy_mirror_and_sd_equal_ar_on_gguf_bundles(arch, vocab_gguf, tmp_path):
    """K-quant targets with a q4_0 draft of another precision (so the draft is often wrong): every mode gives the
    target's own text, one sequence or three at once."""
    source = write_gguf(tmp_path / f"{arch}.gguf", vocab_gguf, arch, seed=3)
    engine = _engine(_export(source, tmp_path / "b", draft_weights="q4_0"), rows=3)
    prompts = ["What is 2+2?", "Name three colours.", "Hello"]
    reference = [engine.generate(p, mode="ar", max_new_tokens=24, ignore_eos=True).tokens for p in prompts]
    for mode in ("sd", "mirror"):
        alone = [engine.generate(p, mode=mode, max_new_tokens=24, ignore_eos=True).tokens for p in prompts]
        assert alone == reference, mode
    streams = [engine.stream(p, mode="mirror", max_new_tokens=24, ignore_eos=True) for p in prompts]
    for gen in streams:
        for _ in gen:
            pass
    assert [g.tokens for g in streams] == reference
    engine.close()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_an_fp32_bundle_computes_what_torch_computes(arch, vocab_gguf, tmp_path, cache_dir):
    """The graphs at fp32 (no int8 activations) against the torch model of the same GGUF: qk norms, biases and
    llama.cpp's paired rotary rows (the torch model takes them back to Hugging Face's order)."""
    import torch

    from mirror_rt.devices.torch.kv_cache import new_cache
    from mirror_rt.models.loading import load_checkpoint

    source = write_gguf(tmp_path / f"{arch}.gguf", vocab_gguf, arch, seed=5, types={"attn": T.F16, "ffn": T.Q8_0})
    engine = _engine(_export(source, tmp_path / "b", weights="fp32"))
    ids = [1, 504, 3458, 314, 260, 3575, 282, 4649, 47, 216]
    cache = engine.target.new_cache(64)
    ours = engine.target.forward(ids, cache)
    model = load_checkpoint(str(source), cache=cache_dir, log=lambda *a: None).model
    with torch.no_grad():
        theirs = model(torch.tensor(ids), new_cache(model, 64)).numpy()
    assert np.abs(ours - theirs).max() <= 2e-2 * np.abs(theirs).max()  # float16 KV in the graphs
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    engine.close()


def test_the_default_models_gguf_runs_on_its_own_blocks(vocab_gguf, tmp_path):
    """SmolLM2's own Q4_1 GGUF (llama: rotary over adjacent pairs) on its blocks with int8 activations agrees with
    its fp32 values at most positions (the quantized model is another model: a near tie may flip), and Mirror gives
    its ar text."""
    engines = {w: _engine(_export(vocab_gguf, tmp_path / w, weights=w)) for w in ("fp32", "gguf")}
    ids = engines["fp32"].prompt_ids("What is the capital of France? Answer in one sentence.")
    logits = {w: e.target.forward(ids, e.target.new_cache(128)) for w, e in engines.items()}
    assert (logits["fp32"].argmax(-1) == logits["gguf"].argmax(-1)).mean() >= 0.9
    engine = engines["gguf"]
    ar = engine.generate("Name a fruit.", mode="ar", max_new_tokens=16, ignore_eos=True).tokens
    assert engine.generate("Name a fruit.", mode="mirror", max_new_tokens=16, ignore_eos=True).tokens == ar
    for e in engines.values():
        e.close()


def test_a_draft_with_more_padding_rows_shares_the_vocabulary(vocab_gguf, tmp_path):
    """A target whose embedding has 64 padding rows more than its draft's: the same tokens, so it drafts."""
    target = write_gguf(tmp_path / "target.gguf", vocab_gguf, "qwen2", seed=7, vocab_rows=49152 + 64)
    draft = write_gguf(tmp_path / "draft.gguf", vocab_gguf, "qwen2", seed=8, layers=1)
    engine = _engine(_export(target, tmp_path / "b", draft_model=str(draft)))
    ar = engine.generate("Hello there", mode="ar", max_new_tokens=16, ignore_eos=True).tokens
    assert engine.generate("Hello there", mode="mirror", max_new_tokens=16, ignore_eos=True).tokens == ar
    engine.close()


def _cli(*args, limit: int | None = None, env: dict | None = None, **kwargs):
    def limited():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.Popen([sys.executable, "-m", "mirror_rt.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=limited if limit else None,
                            env={**os.environ, **(env or {})}, **kwargs)


def test_a_killed_export_leaves_nothing(qwen2_gguf, tmp_path):
    """SIGKILL in the middle of writing weights: no bundle, and the next export sweeps what the process left."""
    out = tmp_path / "b"
    proc = _cli("export", "--model", str(qwen2_gguf), "--out", str(out))
    deadline = time.time() + 120
    while time.time() < deadline and not any(tmp_path.glob("*/weights.bin")) and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    _export(qwen2_gguf, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_out_of_memory_says_what_it_needs_and_what_there_is(vocab_gguf, tmp_path):
    """Torch eager at float64 under an address-space limit that leaves half of what the model needs: one line with
    both figures (before: a traceback, or a message blaming the file)."""

    wide = write_gguf(tmp_path / "wide.gguf", vocab_gguf, "qwen2", layers=1, hidden=1024,
                      types=dict.fromkeys(("embed", "head", "attn", "ffn", "down"), T.F16))
    needed = 2 * 49152 * 1024 * 8  # embedding and head at float64, most of the model
    probe = "import torch, onnxruntime; from mirror_rt.models import loading, memory; print(memory._address_space())"
    baseline = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout)
    proc = _cli("run", "--model", str(wide), "--torch", "--dtype", "float64", "hi", limit=baseline + needed // 2,
                env={"MIRROR_RT_CACHE": str(tmp_path / "cache")})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("mirror-rt: error: out of memory: wide.gguf in torch at float64 needs 0.7"), line
    assert line.endswith(" available"), line


def test_kv_pools_grow_with_requests_and_keep_what_they_hold():
    """A pool starts small and grows to the longest request, rows' positions intact."""
    from mirror_rt.devices.torch.pool import TorchPool

    pool = TorchPool(2, 2, 8, rows=3, capacity=10_000)
    assert pool.allocated < 10_000
    pool.keys[:, 1, :, :5] = 1.5
    pool.commit(1, 5)
    pool.grow(3_000)
    assert pool.allocated >= 3_000 and pool.keys.shape[3] == pool.allocated
    assert float(pool.keys[:, 1, :, :5].min()) == 1.5 and float(pool.keys[:, 1, :, 5:].abs().max()) == 0.0
