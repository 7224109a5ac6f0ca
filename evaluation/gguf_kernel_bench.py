"""One MatMulGGUF product in isolation: milliseconds per call for the 7B's product shapes and R activation rows,
beside the floors this CPU sets (a benchmark, not a test: run it under the bench lock).

    python -m mirror_rt.evaluation.gguf_kernel_bench [--rows 1,2,4,5,8] [--threads 2] [--repeats 5] [--library SO]...

The weights are random blocks with sane scales (a block's speed does not depend on its values), the activations random
floats; the library is the native ops' build for this CPU (exporters.native_op, MIRROR_RT_CPU_VARIANT forces a
variant), or each --library given (another tree's build: side by side, each shape and row count in turn), each
over the weights as its ONNX Runtime op multiplies by them (repacked once where the library repacks them). Floors per
call: `stream` = the weight bytes at --gbps (what memory gives one pass over them); `compute` = 1 cycle per 32 weight
values per row per core (two multiply-pipe ops, maddubs and madd, on the two multiply pipes of a Zen 3 / Skylake core)
at --ghz over --threads cores.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

# (name, type, k, n): Qwen2-7B's products (q and o 3584x3584, gate and up 3584 -> 18944, down 18944 -> 3584; gate/up
# as a Q5_K_M file holds them too), then a Qwen2-0.5B-shaped draft's (gate 896 -> 4864, its head 896 -> 152064) in
# q4_0 (a draft's export), Q4_1 and Q8_0
SHAPES = (("q/o Q4_K", 12, 3584, 3584), ("gate/up Q4_K", 12, 3584, 18944), ("down Q4_K", 12, 18944, 3584),
          ("down Q6_K", 14, 18944, 3584), ("gate/up Q5_K", 13, 3584, 18944), ("0.5B gate Q4_0", 2, 896, 4864),
          ("0.5B head Q4_0", 2, 896, 152064), ("0.5B gate Q4_1", 3, 896, 4864), ("0.5B gate Q8_0", 8, 896, 4864))
# values, bytes, offsets of the block's half scales (Q4_1: d and m)
BLOCKS = {2: (32, 18, (0,)), 3: (32, 20, (0, 2)), 8: (32, 34, (0,)), 12: (256, 144, (0, 2)), 13: (256, 176, (0, 2)),
          14: (256, 210, (208,))}


def random_blocks(kind: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    values, size, halves = BLOCKS[kind]
    w = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    for at in halves:
        w[:, :, at:at + 2] = scale
    return np.ascontiguousarray(w.reshape(n, -1))


class LibraryProduct:
    """A library's product as its ONNX Runtime op runs it: over the weights repacked once (`prepare`, the first call
    with them), where the library repacks them; a library without that entry multiplies the weights as they lie."""

    def __init__(self, threads: int, path: str | None):
        from mirror_rt.exporters import native_op

        try:
            self.prepare, self.product, self.release = native_op.gguf_prepared(threads, path)
        except AttributeError:  # a build from before repacking
            self.prepare, self.product, self.release = None, native_op.gguf_matmul(threads, path), None
        self.handles: dict[int, int | None] = {}

    def __call__(self, x: int, w: int, y: int, rows: int, k: int, n: int, kind: int) -> int:
        if self.prepare is None:
            return self.product(x, w, y, rows, k, n, kind)
        if w not in self.handles:
            self.handles[w] = self.prepare(w, k, n, kind)
        return self.product(self.handles[w], x, w, y, rows, k, n, kind)

    def forget(self) -> None:
        """Release the repackings made (call before the weights they were made of go)."""
        for handle in self.handles.values():
            if handle is not None:
                self.release(handle)
        self.handles.clear()


def best_ms(matmul, x: np.ndarray, w: np.ndarray, y: np.ndarray, kind: int, repeats: int) -> float:
    rows, k = x.shape
    best = float("inf")
    for _ in range(repeats + 1):  # the first call: helpers started, pages touched
        start = time.perf_counter()
        assert matmul(x.ctypes.data, w.ctypes.data, y.ctypes.data, rows, k, y.shape[1], kind) == 0
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,5,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gbps", type=float, default=13.0, help="memory bandwidth for the stream floor")
    parser.add_argument("--ghz", type=float, default=2.45, help="core clock for the compute floor")
    parser.add_argument("--library", action="append", help="a built libmirror_rt_ops.so to time (repeatable)")
    args = parser.parse_args(argv)
    counts = [int(r) for r in args.rows.split(",")]
    from mirror_rt.exporters import native_op

    paths = args.library or [None]
    kernels = [LibraryProduct(args.threads, path) for path in paths]
    names = [path.split("/")[-2] if path else native_op.chosen_variant() for path in paths]
    rng = np.random.default_rng(0)
    print(f"{args.threads} threads; ms per call, best of {args.repeats} (floors: stream at {args.gbps} GB/s, "
          f"compute 1 cycle / 32 values / row / core at {args.ghz} GHz)")
    print(f"{'product':14} {'library':26} {'MB':>5} {'stream':>6} " + " ".join(f"{'R=' + str(r):>7}" for r in counts)
          + "  compute per row")
    for name, kind, k, n in SHAPES:
        w = random_blocks(kind, n, k, rng)
        cells = {}
        for rows in counts:
            x = rng.standard_normal((rows, k)).astype(np.float32)
            y = np.empty((rows, n), dtype=np.float32)
            for library, matmul in zip(names, kernels):
                cells[library, rows] = best_ms(matmul, x, w, y, kind, args.repeats)
        for matmul in kernels:
            matmul.forget()
        stream = w.nbytes / args.gbps / 1e6
        compute = k * n / 32 / args.threads / args.ghz / 1e6
        for library in names:
            print(f"{name:14} {library:26} {w.nbytes / 1e6:5.1f} {stream:6.2f} "
                  + " ".join(f"{cells[library, rows]:7.2f}" for rows in counts) + f"  {compute:.2f}")


if __name__ == "__main__":
    main()
