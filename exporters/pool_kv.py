"""Target attention through mirror-rt's own ONNX Runtime op, which reads the KV buffers in place (format 7).

The contract of exporters.exact_kv in one node a layer: `mirror_rt::PoolAttention` stores the call's keys and
values into the buffers in place and attends each query to its own row's keys, in a fixed order of sums, so a
position's bits do not depend on its companions or the call's tokens. Graphs with it need the library
exporters.native_op builds, where they are exported and wherever they load.
Design notes: docs/design/exporters.md
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
