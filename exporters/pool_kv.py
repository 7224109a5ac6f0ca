"""Target attention through mirror-rt's own ONNX Runtime op, which reads the KV buffers in place (format 7).

The same contract as exporters.exact_kv (buffers [B, KVH, capacity, D] written in place at total_len-T..
total_len-1 of each row, RoPE at positions [B, T], causal attention to 0..position of the row's own keys, every
position computed alike in any call shape), with one node where exact_kv has some forty: after RoPE,
`mirror_rt::PoolAttention` (exporters/pool_attention.cpp) stores the call's keys and values into the buffers (bound
as both its input and its output, so in place; float16 ones rounded to nearest even) and attends each query to its
own row's keys 0..position where they lie. exact_kv's graphs copy every group of rows'
keys and values out of the buffers (Slice), then read them again in a product padded to the group's longest row;
here nothing is copied, no row reads past its own length, and no mask or group plan is built, so the graphs take no
`attention_groups`. The op's arithmetic is fixed per query (its own order of sums over lanes and keys), which is
what makes a position's bits independent of its companions and of the call's tokens.
Graphs with the op need the library exporters.native_op builds, in the exporting process (to check the graph) and
in every process that loads it (devices.onnxruntime.backend registers it with each session).
"""

from __future__ import annotations

import torch

from mirror_rt.exporters.native_op import DOMAIN, OP, OP_HALF
from mirror_rt.exporters.shared_kv import DOMAIN as ROPE_DOMAIN


class PoolAttention(torch.autograd.Function):
    """One layer: q [B, T, H*D], k, v [B, T, KVH*D] (before RoPE), buffers [B, KVH, S, D] -> (out [B, T, H*D],
    present k, v: the same buffers). Its eager forward only gives the tracer shapes."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, positions, cos, sin, n_heads: int, n_kv_heads: int):
        return torch.zeros_like(q), past_k.clone(), past_v.clone()

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, positions, cos, sin, n_heads: int, n_kv_heads: int):
        shape = q.type()
        half = past_k.type().scalarType() == "Half"  # float16 buffers (ExportConfig.kv_dtype)
        rotary = dict(interleaved_i=0)
        q = g.op(f"{ROPE_DOMAIN}::RotaryEmbedding", q, positions, cos, sin, num_heads_i=n_heads, **rotary)
        k = g.op(f"{ROPE_DOMAIN}::RotaryEmbedding", k, positions, cos, sin, num_heads_i=n_kv_heads, **rotary)
        out, present_k, present_v = g.op(f"{DOMAIN}::{OP_HALF if half else OP}", q, k, v, past_k, past_v, positions,
                                         outputs=3)
        out.setType(shape)
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


def pool_rope_attention(q, k, v, past_k, past_v, rope, n_heads: int, n_kv_heads: int):
    """As exporters.exact_kv.exact_rope_attention (rope = (cos, sin [table, D/2], positions [B, T])), through
    mirror_rt::PoolAttention, which also stores the call's keys and values."""
    cos, sin, positions = rope
    return PoolAttention.apply(q, k, v, past_k, past_v, positions, cos, sin, n_heads, n_kv_heads)
