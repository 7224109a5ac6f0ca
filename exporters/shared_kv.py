"""Attention over shared, preallocated KV buffers written in place: onnxruntime's GroupQueryAttention.

Each layer's past key/value is a [B, kv_heads, capacity, head_dim] buffer bound as past and present (no
copy; a rollback is a smaller `total_len`); the op writes rows' new keys at total_len-T.. and attends causally.
A call over several rows takes one token per row. ONNX Runtime only. Drafts attend through it; targets through
exporters.exact_kv or exporters.pool_kv, whose positions come out alike in every call shape.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import torch

DOMAIN = "com.microsoft"
GQA_HEAD_MULTIPLE = 8  # the op's CPU kernel takes head sizes that are multiples of 8 only
TOTAL_LEN = "total_len"  # int32 [B]: positions each row holds after the call


class GroupQueryAttention(torch.autograd.Function):
    """Traces to com.microsoft::GroupQueryAttention; its eager forward only gives the tracer shapes.

    Given cos/sin caches [table_len, head_dim / 2] and position_ids [B, T], the op also rotates
    q and k (do_rotary, half-rotation layout) so no RoPE nodes surround it.
    """

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens_k, total_len, cos, sin, position_ids,
                num_heads: int, kv_num_heads: int):
        return torch.zeros_like(q), past_k.clone(), past_v.clone()

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens_k, total_len, cos, sin, position_ids,
                 num_heads: int, kv_num_heads: int):
        rotary = cos is not None
        inputs = (q, k, v, past_k, past_v, seqlens_k, total_len) + ((cos, sin, position_ids) if rotary else ())
        out, present_k, present_v = g.op(f"{DOMAIN}::GroupQueryAttention", *inputs, num_heads_i=num_heads,
                                         kv_num_heads_i=kv_num_heads, do_rotary_i=int(rotary), outputs=3)
        out.setType(q.type())
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


def shared_kv_rope_attention(q, k, v, past_k, past_v, total_len, rope, n_heads: int, n_kv_heads: int):
    """Projections q [B, T, H*D], k/v [B, T, KVH*D] before RoPE; rope = (cos, sin [table, D/2], positions
    [B, T]); buffers [B, KVH, S, D]; total_len [B] -> ([B, T, H*D], present k, v). The op rotates q and k."""
    total = total_len.to(torch.int32)
    total_max = total.max().reshape(1)  # the op's total_sequence_length: the longest row
    return GroupQueryAttention.apply(q, k, v, past_k, past_v, total - 1, total_max, *rope, n_heads, n_kv_heads)
