"""`mirror-rt bench --rows 1,2,4,...`: what one target forward of N new rows costs (a prompt's reading, a verify
window and a batch all ask the target for many rows at once), best of ROWS_REPEATS, in seconds and per row, beside
llama.cpp's `Llama.eval` of N tokens at the same threads where llama-cpp-python is installed. Each row says the
target's precision; the table's head says the CPU and which variant of the native kernels ran.

Our figure is the engine's own: `Engine.generate(ids, mode="ar", max_new_tokens=1)` and its
`stats["stage_seconds"]["target_prefill"]`, ids drawn afresh for every run (no prefix reuse). WARM_UP untimed
forwards of one row come first, on both sides: the first forwards after a load map the weights' pages (a 7B's first
forward took 10.9 s here, its next ones 0.37 s, then 0.34 s); without them the first N measured (one row) paid for
it and cost more than two rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

ROWS_REPEATS = 3  # runs per N: the best counts (the first run of a shape allocates)
WARM_UP = 3  # untimed one-row forwards before the first N (pages of the weights mapped, caches and helpers warm)
WARM_SEED = 1 << 20  # warm-up ids: runs past any measured one (fresh_ids)
NOT_INSTALLED = "llama.cpp: not installed (pip install -e '.[llama-cpp]')"
SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class RowCost:
    """One N: our best forward and llama.cpp's (None: not run), seconds."""

    rows: int
    seconds: float
    precision: str
    llama_seconds: float | None = None


def row_counts(text: str) -> list[int]:
    """--rows: comma-separated whole numbers >= 1, each once, in the order given."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(item.isdigit() and int(item) >= 1 for item in items):
        raise ValueError(f"--rows: expected comma-separated whole numbers >= 1, got '{text}'")
    counts = [int(item) for item in items]
    if len(set(counts)) < len(counts):
        raise ValueError(f"--rows: a count is named twice in '{text}'")
    return counts


def fresh_ids(rows: int, run: int, vocab: int) -> list[int]:
    """`rows` token ids for run `run`, alike in kind, different from every other (rows, run): no prefix is reused."""
    rng = np.random.default_rng([rows, run])
    low = min(100, vocab // 4)  # past the usual special and byte tokens
    return [int(t) for t in rng.integers(low, vocab, size=rows)]


def target_seconds(engine, rows: int, repeats: int = ROWS_REPEATS) -> float:
    """Best target_prefill seconds of `repeats` forwards of `rows` new rows through `engine`."""
    best = math.inf
    for run in range(repeats):
        gen = engine.generate(fresh_ids(rows, run, engine.target.vocab_size), chat=False, mode="ar",
                              max_new_tokens=1)
        best = min(best, gen.stats["stage_seconds"]["target_prefill"])
    return best


def llama_model(model: str | None, cache: str | None, threads: int, most_rows: int):
    """llama.cpp over the model's GGUF (evaluation.bench_llama.find_gguf) at `threads`, able to take `most_rows`
    tokens in one eval: (the model, a line saying what it is) or (None, a line saying why not)."""
    try:
        import llama_cpp
    except ImportError:
        return None, NOT_INSTALLED
    from mirror_rt.evaluation.bench_llama import find_gguf

    gguf = find_gguf(model, cache)
    if gguf is None:
        return None, "llama.cpp: needs the model as a .gguf file (--model path/to/model.gguf)"
    llm = llama_cpp.Llama(str(gguf), n_ctx=most_rows + 8, n_batch=most_rows, n_ubatch=most_rows, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    return llm, f"llama.cpp: llama-cpp-python {llama_cpp.__version__}, {threads} thread{'s' * (threads > 1)}"


def llama_seconds(llm, rows: int, repeats: int = ROWS_REPEATS) -> float:
    """Best seconds of `repeats` `Llama.eval` calls of `rows` tokens, each from an empty cache."""
    best = math.inf
    for run in range(repeats):
        llm.reset()
        ids = fresh_ids(rows, run, llm.n_vocab())
        start = time.perf_counter()
        llm.eval(ids)
        best = min(best, time.perf_counter() - start)
    return best


def cpu_line() -> str:
    """`CPU: AMD EPYC 7B13 (avx2, fma, f16c); kernels: avx2 variant`: the model name, the vector features that
    matter, and the native kernels' variant where the build has variants."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    shown = [flag for flag in SHOWN_FLAGS if flag in flags] or ["none of " + ", ".join(SHOWN_FLAGS[:3])]
    return f"CPU: {model} ({', '.join(shown)}); kernels: {kernel_variant()}"


def kernel_variant() -> str:
    """The native kernels' variant this process loads (exporters.native_op), else how they are built."""
    from mirror_rt.exporters import native_op

    chosen = getattr(native_op, "chosen_variant", None)
    if chosen is None:
        return "one build for this CPU (-march=native)"
    try:
        name = chosen()
        if name.endswith("-amx"):
            tiles = "AMX tiles for Q4_K/Q6_K rows" if native_op.amx_tiles() else "the OS refused AMX tiles"
            return f"{name} variant ({tiles})"
        return f"{name} variant"
    except native_op.NativeOpUnavailable as exc:
        return f"none ({exc})"


def warm_up(engine, llm=None, forwards: int = WARM_UP) -> None:
    """`forwards` untimed one-row forwards through `engine` and `llm` (where given), ids unlike the measured ones."""
    for run in range(forwards):
        ids = fresh_ids(1, WARM_SEED + run, engine.target.vocab_size)
        engine.generate(ids, chat=False, mode="ar", max_new_tokens=1)
        if llm is not None:
            llm.reset()
            llm.eval(fresh_ids(1, WARM_SEED + run, llm.n_vocab()))


def measure(engine, counts: list[int], llm=None, repeats: int = ROWS_REPEATS, log=print) -> list[RowCost]:
    """Our cost and llama.cpp's (where `llm`) of each N in `counts`, after `warm_up`."""
    precision = engine.names.get("target_precision", "?")
    warm_up(engine, llm)
    costs = []
    for rows in counts:  # each said as measured: a run cut short still shows what it measured
        ours = target_seconds(engine, rows, repeats)
        costs.append(RowCost(rows, ours, precision, llama_seconds(llm, rows, repeats) if llm is not None else None))
        theirs = "" if llm is None else f", llama.cpp {costs[-1].llama_seconds:.4f} s"
        log(f"bench --rows: {rows} row{'s' * (rows > 1)}: {ours:.4f} s{theirs}")
    return costs


def table(costs: list[RowCost], head: str, llama: str, threads: int | None, repeats: int = ROWS_REPEATS) -> str:
    """The report: a line on what ran, then a row per N."""
    ran = f"{threads} thread{'s' * (threads != 1)}" if threads else "its default threads"
    lines = [f"target forward of N new rows, best of {repeats} (seconds; ms per row), mirror-rt at {ran}", head,
             llama, "", "| rows N | mirror-rt s | ms per row | precision | llama.cpp s | ms per row | llama.cpp / "
             "ours |", "|---|---|---|---|---|---|---|"]
    for c in costs:
        theirs = c.llama_seconds
        other = ("-", "-", "-") if theirs is None else (f"{theirs:.4f}", f"{1e3 * theirs / c.rows:.2f}",
                                                         f"{theirs / c.seconds:.2f}x" if c.seconds > 0 else "-")
        lines.append(f"| {c.rows} | {c.seconds:.4f} | {1e3 * c.seconds / c.rows:.2f} | {c.precision} | "
                     f"{' | '.join(other)} |")
    return "\n".join(lines)
