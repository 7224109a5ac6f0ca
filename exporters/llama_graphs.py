"""The four graphs of a bundle (target prefix, exit, suffix; draft) written from a checkpoint's weights as they lie.

The interface of the traced pool graphs of format 7 (exporters.pool_kv), so devices.onnxruntime.backend runs
them unchanged. Every product is mirror_rt::MatMulGGUF over rows in weights.bin (a GGUF's blocks, or values at
fp32 / bf16 / f16 / q8_0 / q4_0); a llama GGUF's q and k rows keep its pairwise rotary order in every graph, so a
self-draft can take the target's KV. Weights are read one tensor at a time.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto

from mirror_rt.exporters.graph_writer import GraphBuilder, WeightsFile
from mirror_rt.exporters.native_op import DOMAIN as NATIVE
from mirror_rt.exporters.native_op import OP, OP_HALF
from mirror_rt.models.tensor_files import BF16, F16, F32

ROPE_DOMAIN = "com.microsoft"
Q8_0, Q4_0 = 8, 2
KERNEL_TYPES = {0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30}  # GGML types MatMulGGUF computes on (exporters/gguf_blocks.inc)
PRECISIONS = {"fp32": F32, "f16": F16, "bf16": BF16, "q8_0": Q8_0, "q4_0": Q4_0, "gguf": None}


@dataclass(frozen=True)
class GraphPlan:
    """One graph: its role, its layers, its weights' precision."""

    role: str  # target_prefix | target_exit | target_suffix | draft
    first: int  # first layer (inclusive)
    last: int  # last layer (exclusive)
    precision: str  # a key of PRECISIONS
    kappa: int = 0  # target_exit: candidates per position
    kv_half: bool = True  # KV buffers of float16 (PoolAttentionHalf)


def row_bytes(ggml_type: int, columns: int) -> int:
    """Bytes of one row of `columns` values stored as GGML type `ggml_type` (gguf-py's table of block sizes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return columns // values * nbytes


class LlamaGraphs:
    """Writes graphs of one checkpoint (`source`: models.weights) into `folder`, sharing one weights.bin."""

    def __init__(self, source, folder: Path, file: WeightsFile | None = None):
        self.source, self.config, self.folder = source, source.config, Path(folder)
        self.file = file or WeightsFile(folder)  # a draft of another checkpoint writes into the target's file
        self.interleaved = int(bool(source.permuted))

    def write(self, plan: GraphPlan, path: Path, progress=lambda: None) -> None:
        """Write the graph of `plan` to `path`; `progress()` after each layer (and once for the exit)."""
        b = GraphBuilder(plan.role)
        c = self.config
        if plan.role == "target_exit":
            hidden = b.input("hidden", TensorProto.FLOAT, ["window", c.hidden_size])
            logits = self._head(b, hidden, plan)
            logprobs = b.op("LogSoftmax", [logits], axis=-1)
            values, ids = b.op("TopK", [logprobs, b.const(np.array([plan.kappa], np.int64))],
                               ["exit_logprobs", "exit_ids"], axis=-1)
            b.output("exit_ids", TensorProto.INT64, ["window", plan.kappa])
            b.output("exit_logprobs", TensorProto.FLOAT, ["window", plan.kappa])
            b.save(path, {NATIVE: 1})
            progress()
            return
        takes_ids = plan.role in ("target_prefix", "draft")
        x = (b.input("input_ids", TensorProto.INT64, ["batch", "window"]) if takes_ids
             else b.input("hidden", TensorProto.FLOAT, ["batch", "window", c.hidden_size]))
        last_rows = b.input("last_rows", TensorProto.INT64, [1]) if plan.role != "target_prefix" else None
        total_len = b.input("total_len", TensorProto.INT32, ["batch"])
        kv_type = TensorProto.FLOAT16 if plan.kv_half else TensorProto.FLOAT
        kv_shape = ["batch", c.n_kv_heads, "capacity", c.head_dim]
        past = [b.input(f"past_{kind}.{i}", kv_type, kv_shape)
                for i in range(plan.last - plan.first) for kind in ("key", "value")]
        h = self._embed(b, x, plan) if takes_ids else x
        rope = self._rope(b, x, total_len)
        for i in range(plan.first, plan.last):
            local = i - plan.first
            h = self._layer(b, h, i, past[2 * local:2 * local + 2], [f"present_key.{local}", f"present_value.{local}"],
                            rope, plan)
            progress()
        if plan.role == "target_prefix":
            b.op("Identity", [h], ["hidden"])
            b.output("hidden", TensorProto.FLOAT, ["batch", "window", c.hidden_size])
        else:
            rows = b.op("Sub", [b.op("Shape", [h], start=1, end=2), last_rows])
            h = b.op("Slice", [h, rows, b.const(np.array([1 << 62], np.int64)), b.const(np.array([1], np.int64))])
            b.op("Identity", [self._head(b, h, plan)], ["logits"])
            b.output("logits", TensorProto.FLOAT, ["batch", "rows", c.vocab_size])
        for local in range(plan.last - plan.first):
            for kind in ("key", "value"):
                b.output(f"present_{kind}.{local}", kv_type, kv_shape)
        b.save(path, {ROPE_DOMAIN: 1, NATIVE: 1}, {"attention": "pool"})

    def close(self) -> None:
        self.file.close()

    # --- pieces of a graph -------------------------------------------------------------------

    def _layer(self, b: GraphBuilder, x: str, i: int, past: list, present: list, rope: tuple, plan: GraphPlan) -> str:
        c, name = self.config, f"layers.{i}."
        h = self._norm(b, x, name + "attn_norm")
        q, k, v = (self._product(b, h, name + p, plan, bias=name + p + "_bias") for p in ("q", "k", "v"))
        if c.qk_norm:
            q = self._head_norm(b, q, name + "q_norm", c.n_heads)
            k = self._head_norm(b, k, name + "k_norm", c.n_kv_heads)
        positions, ids, cos, sin = rope
        q = b.op("RotaryEmbedding", [q, ids, cos, sin], domain=ROPE_DOMAIN, num_heads=c.n_heads,
                 interleaved=self.interleaved)
        k = b.op("RotaryEmbedding", [k, ids, cos, sin], domain=ROPE_DOMAIN, num_heads=c.n_kv_heads,
                 interleaved=self.interleaved)
        attended = b.op(OP_HALF if plan.kv_half else OP, [q, k, v, past[0], past[1], positions],
                        [b.fresh("attended"), *present], domain=NATIVE)[0]
        x = b.op("Add", [x, self._product(b, attended, name + "o", plan)])
        h = self._norm(b, x, name + "ffn_norm")
        gate, up = self._product(b, h, name + "gate", plan), self._product(b, h, name + "up", plan)
        mixed = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])
        return b.op("Add", [x, self._product(b, mixed, name + "down", plan)])

    def _norm(self, b: GraphBuilder, x: str, name: str) -> str:
        weight = b.const(self.source.array(name).astype(np.float32))
        return b.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=float(self.config.norm_eps),
                    stash_type=1)

    def _head_norm(self, b: GraphBuilder, x: str, name: str, heads: int) -> str:
        """Qwen3's per-head RMSNorm of q or k [B, T, heads * D]."""
        c = self.config
        split = b.op("Reshape", [x, b.const(np.array([0, 0, heads, c.head_dim], np.int64))])
        normed = self._norm(b, split, name)
        return b.op("Reshape", [normed, b.const(np.array([0, 0, heads * c.head_dim], np.int64))])

    def _head(self, b: GraphBuilder, h: str, plan: GraphPlan) -> str:
        """The final norm and LM head (the embedding's rows when tied) -> logits."""
        name = "head" if "head" in self.source.tensors else "embed"
        return self._product(b, self._norm(b, h, "norm"), name, plan)

    def _embed(self, b: GraphBuilder, ids: str, plan: GraphPlan) -> str:
        weight, ggml_type, info = self._weight(b, "embed", plan)
        return b.op("GatherGGUF", [ids, weight], domain=NATIVE, type=ggml_type, k=info.columns)

    def _product(self, b: GraphBuilder, x: str, name: str, plan: GraphPlan, bias: str | None = None) -> str:
        weight, ggml_type, info = self._weight(b, name, plan)
        y = b.op("MatMulGGUF", [x, weight], domain=NATIVE, type=ggml_type, k=info.columns)
        if bias and bias in self.source.tensors:
            y = b.op("Add", [y, b.const(self.source.array(bias).astype(np.float32))])
        return y

    def _weight(self, b: GraphBuilder, name: str, plan: GraphPlan):
        """The external initializer of weight `name` at the plan's precision (written to weights.bin once)."""
        info = self.source.tensors[name]
        ggml_type, write = self._encoding(info, plan.precision)
        where = self.file.add((str(self.source.path), name, ggml_type), write)
        tensor = b.external(f"{name}.{ggml_type}.{where[0]}", np.uint8, (info.rows, row_bytes(ggml_type, info.columns)),
                            where)
        return tensor, ggml_type, info

    def _encoding(self, info, precision: str):
        """(GGML type, a writer of its rows) of one weight at `precision`: the file's own bytes when they are
        already that (copied in chunks), else values converted one tensor at a time."""
        wanted = PRECISIONS[precision]
        if wanted is None:  # the checkpoint's own blocks, where the kernel computes on them
            wanted = info.type if info.type in KERNEL_TYPES else Q8_0
        if wanted == info.type:
            return wanted, lambda f: _copy_bytes(info, f)
        return wanted, lambda f: f.write(_convert(self._values(info.name), wanted).tobytes())

    def _values(self, name: str) -> np.ndarray:
        """One weight as float32 [rows, columns], rows in the file's order (a llama GGUF's q and k stay paired)."""
        return self.source.array(name, hf_order=False) if self.source.permuted else self.source.array(name)

    def _rope(self, b: GraphBuilder, x: str, total_len: str) -> tuple:
        """(positions [B, T], their flat indices [B, T], cos, sin [B * T, D / 2]): positions total_len - T + t."""
        window = b.op("Shape", [x], start=1, end=2)
        zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
        total = b.op("Unsqueeze", [b.op("Cast", [total_len], to=TensorProto.INT64), b.const(np.array([1], np.int64))])
        steps = b.op("Range", [zero, b.op("Squeeze", [window]), one])
        positions = b.op("Add", [b.op("Sub", [total, window]), steps])  # [B, T]
        flat = b.op("Reshape", [positions, b.const(np.array([-1, 1], np.int64))])
        angles = b.op("Mul", [b.op("Cast", [flat], to=TensorProto.DOUBLE), b.const(self._inverse_frequencies()[None])])
        cos = b.op("Cast", [b.op("Cos", [angles])], to=TensorProto.FLOAT)
        sin = b.op("Cast", [b.op("Sin", [angles])], to=TensorProto.FLOAT)
        count = b.op("ReduceProd", [b.op("Shape", [positions])], keepdims=0)
        ids = b.op("Reshape", [b.op("Range", [zero, count, one]), b.op("Shape", [positions])])
        return positions, ids, cos, sin

    def _inverse_frequencies(self) -> np.ndarray:
        """RoPE frequencies [D / 2] in float64, with the model's scaling (linear, llama3, or a GGUF's rope_freqs)."""
        from mirror_rt.models.transformer import rope_inv_freq

        inverse = rope_inv_freq(self.config).numpy()  # float64
        if "rope_freqs" in self.source.tensors:
            inverse = inverse / self.source.array("rope_freqs").astype(np.float64)
        return inverse


def _copy_bytes(info, out, chunk: int = 1 << 24) -> None:
    with open(info.file, "rb") as source:
        source.seek(info.offset)
        left = info.nbytes
        while left:
            data = source.read(min(chunk, left))
            if not data:
                raise ValueError(f"{info.file} is cut short inside {info.name}")
            out.write(data)
            left -= len(data)


def _convert(values: np.ndarray, ggml_type: int) -> np.ndarray:
    """float32 rows [rows, columns] as GGML type rows (uint8 bytes)."""
    values = np.ascontiguousarray(values.reshape(values.shape[0] if values.ndim > 1 else 1, -1), dtype=np.float32)
    if ggml_type == F32:
        return values.view(np.uint8)
    if ggml_type == F16:
        return values.astype(np.float16).view(np.uint8)
    if ggml_type == BF16:  # round to nearest even
        bits = values.view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)
    from gguf.quants import quantize

    return quantize(values, ggml_type)
