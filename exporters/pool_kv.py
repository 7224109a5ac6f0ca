"""Target attention through mirror-rt's own ONNX Runtime op, which reads the KV buffers in place (format 7).

The same contract as exporters.exact_kv (buffers [B, KVH, capacity, D] written in place at total_len-T..
total_len-1 of each row, RoPE at positions [B, T], causal attention to 0..position of the row's own keys, every
position computed alike in any call shape), with one node where exact_kv has some forty: after RoPE and the
ScatterND that writes the call's keys and values, `mirror_rt::PoolAttention` (exporters/pool_attention.cpp)
attends each query to its own row's keys 0..position where they lie. exact_kv's graphs copy every group of rows'
keys and values out of the buffers (Slice), then read them again in a product padded to the group's longest row;
here nothing is copied, no row reads past its own length, and no mask or group plan is built, so the graphs take no
`attention_groups`. The op's arithmetic is fixed per query (its own order of sums over lanes and keys), which is
what makes a position's bits independent of its companions and of the call's tokens.
Graphs with the op need the library exporters.native_op builds, in the exporting process (to check the graph) and
in every process that loads it (devices.onnxruntime_backend registers it with each session).
"""

from __future__ import annotations

import torch

from mirror_rt.exporters.exact_kv import rotate_and_store, scatter_indices
from mirror_rt.exporters.native_op import DOMAIN, OP, OP_HALF


class ScatterPlan(torch.autograd.Function):
    """The ScatterND indices [B, KVH, T, 3] every layer of a call shares; eager forward: shapes for the tracer."""

    @staticmethod
    def forward(ctx, positions, n_kv_heads: int):
        B, T = positions.shape
        return torch.zeros(B, n_kv_heads, T, 3, dtype=torch.long)

    @staticmethod
    def symbolic(g, positions, n_kv_heads: int):
        return scatter_indices(g, positions, n_kv_heads)


class PoolAttention(torch.autograd.Function):
    """One layer: q [B, T, H*D], k, v [B, T, KVH*D] (before RoPE), buffers [B, KVH, S, D] -> (out [B, T, H*D],
    present k, v: the same buffers). Its eager forward only gives the tracer shapes."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, positions, cos, sin, indices, n_heads: int, n_kv_heads: int,
                head_dim: int):
        return torch.zeros_like(q), past_k.clone(), past_v.clone()

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, positions, cos, sin, indices, n_heads: int, n_kv_heads: int,
                 head_dim: int):
        shape = q.type()
        half = past_k.type().scalarType() == "Half"  # float16 buffers (ExportConfig.kv_dtype)
        q, present_k, present_v = rotate_and_store(g, q, k, v, past_k, past_v, positions, cos, sin, indices, n_heads,
                                                   n_kv_heads, head_dim, half)
        out = g.op(f"{DOMAIN}::{OP_HALF if half else OP}", q, present_k, present_v, positions)
        out.setType(shape)
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


def pool_attention_plan(positions, n_kv_heads: int):
    """The per-call part every layer shares, computed once per graph."""
    return ScatterPlan.apply(positions, n_kv_heads)


def pool_rope_attention(q, k, v, past_k, past_v, rope, indices, n_heads: int, n_kv_heads: int, head_dim: int):
    """As exporters.exact_kv.exact_rope_attention (rope = (cos, sin [table, D/2], positions [B, T])), through
    mirror_rt::PoolAttention; `indices` from pool_attention_plan."""
    cos, sin, positions = rope
    return PoolAttention.apply(q, k, v, past_k, past_v, positions, cos, sin, indices, n_heads, n_kv_heads, head_dim)
