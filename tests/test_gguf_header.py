"""A GGUF file mirror-rt cannot run is refused from its header, before any export (the console script `mirror-rt`
in a subprocess): an unsupported architecture and a cut-short file were refused only after gguf-py's reader (40-50 s
on a 7B's tokenizer) behind an export progress bar, the cut-short one quoting numpy's reshape error. Files written
here: a few small tensors, no tokenizer (the header is all the check reads)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mirror_rt.models.gguf_header import GGUFError, check_gguf, read_header

pytest.importorskip("gguf")


def write_small_gguf(path: Path, arch: str = "qwen2") -> Path:
    """A two-layer header of `arch` with float32 tensors (random), and a string array as a tokenizer has."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_token_list([f"t{i}" for i in range(300)])
    writer.add_token_scores([0.0] * 300)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((300, 32), dtype=np.float32))
    for i in range(2):
        writer.add_tensor(f"blk.{i}.attn_q.weight", rng.standard_normal((32, 32), dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cut(source: Path, out: Path, keep: int) -> Path:
    out.write_bytes(source.read_bytes()[:keep])
    return out


def mirror_rt(*args, cache: Path) -> subprocess.CompletedProcess:
    script = shutil.which("mirror-rt") or [sys.executable, "-m", "mirror_rt.cli"]
    command = [script] if isinstance(script, str) else script
    env = {**os.environ, "MIRROR_RT_CACHE": str(cache)}
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=env)


def test_a_whole_file_s_header_says_where_its_data_end(tmp_path):
    path = write_small_gguf(tmp_path / "m.gguf")
    header = check_gguf(path)
    assert header.architecture == "qwen2" and header.tensors == 5
    assert header.data_end == header.size == path.stat().st_size
    assert header.metadata["qwen2.block_count"] == 2 and header.metadata["tokenizer.ggml.tokens"] is None


@pytest.mark.parametrize("keep", [100, -1000])
def test_a_cut_short_file_says_how_many_bytes_it_needs_and_has(tmp_path, keep):
    whole = write_small_gguf(tmp_path / "m.gguf")
    size = whole.stat().st_size
    short = cut(whole, tmp_path / "short.gguf", keep if keep > 0 else size + keep)
    with pytest.raises(GGUFError) as caught:
        check_gguf(short)
    message = str(caught.value)
    assert "cut short" in message and "reshape" not in message and "\n" not in message
    if keep < 0:  # within the tensors' data: both sizes, exactly
        assert f"need {size} bytes, the file has {size + keep} ({-keep} missing" in message, message
    else:
        assert "within its header" in message and "ends at byte 100" in message, message


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFError, match="not a GGUF model"):
        read_header(path)


@pytest.mark.parametrize("case", ["gemma3", "cut short"])
def test_the_cli_refuses_from_the_header_before_any_export(tmp_path, case):
    """`mirror-rt run --model X.gguf`: one line, no export progress bar, nothing written into the cache."""
    if case == "gemma3":
        model = write_small_gguf(tmp_path / "gemma.gguf", arch="gemma3")
        says = "unsupported architecture 'gemma3'"
    else:
        whole = write_small_gguf(tmp_path / "m.gguf")
        model = cut(whole, tmp_path / "cut.gguf", whole.stat().st_size - 500)
        says = f"is cut short: its 5 tensors need {whole.stat().st_size} bytes, the file has"
    cache = tmp_path / "cache"
    proc = mirror_rt("run", "--model", str(model), "--max-new-tokens", "2", "hi", cache=cache)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mirror-rt: error:") and says in lines[0], proc.stderr
    assert "export" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (cache / "bundles").exists() or not any((cache / "bundles").iterdir())


def test_without_the_native_ops_a_gguf_is_refused_before_export_naming_torch(tmp_path, monkeypatch):
    """Every product of a GGUF's graphs is mirror-rt's MatMulGGUF: there is no standard-op form to fall back to
    (docs said exports fell back), so where the ops cannot be built the export is refused at once, saying --torch."""
    from mirror_rt.exporters import native_op
    from mirror_rt.exporters.export_config import ExportConfig, ExportError
    from mirror_rt.exporters.stream_export import streams

    def unavailable(cache=None):
        raise native_op.NativeOpUnavailable("no C++ compiler (set $CXX, or install g++) to build mirror-rt's "
                                            "attention op")

    monkeypatch.setattr(native_op, "library", unavailable)
    model = write_small_gguf(tmp_path / "m.gguf")
    with pytest.raises(ExportError, match=r"cannot be built here \(no C\+\+ compiler.*run the model in torch eager "
                                          r"with --torch"):
        streams(ExportConfig(model=str(model), out_dir=tmp_path / "out"))
