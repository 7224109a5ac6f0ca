"""Attention over a shared, preallocated KV buffer: onnxruntime's GroupQueryAttention contrib op.

Graphs exported with `shared_kv` take each layer's past key/value as a [1, kv_heads, capacity,
head_dim] buffer and `total_len` (positions after this call); the op writes the window's keys
and values in place at positions total_len-T..total_len-1 and attends causally to 0..total_len-1.
ONNX Runtime binds past and present to the same buffer (IO binding), so a call copies no cache
and a rollback is only a smaller `total_len` next time. Measured here: the explicit-KV graphs spent
a quarter of a draft forward at 800 positions concatenating caches. Only ONNX Runtime runs these
graphs (CPU and CUDA execution providers implement the op); OpenVINO does not load them.
"""

from __future__ import annotations

import torch

DOMAIN = "com.microsoft"
TOTAL_LEN = "total_len"  # int32 [1]: positions held after the call (the op's total_sequence_length)


class GroupQueryAttention(torch.autograd.Function):
    """Traces to com.microsoft::GroupQueryAttention; its eager forward only gives the tracer shapes.

    Given cos/sin caches [table_len, head_dim / 2] and position_ids [1, T], the op also rotates
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


def shared_kv_attention(q, k, v, past_k, past_v, total_len, n_heads: int, n_kv_heads: int):
    """q [H, T, D], k/v [KVH, T, D] (RoPE applied) over buffers [1, KVH, S, D] -> ([T, H*D], present k, v)."""
    D = q.shape[-1]
    total = total_len.to(torch.int32)
    out, present_k, present_v = GroupQueryAttention.apply(
        q.transpose(0, 1).reshape(1, -1, n_heads * D), k.transpose(0, 1).reshape(1, -1, n_kv_heads * D),
        v.transpose(0, 1).reshape(1, -1, n_kv_heads * D), past_k, past_v, total - 1, total, None, None, None,
        n_heads, n_kv_heads)
    return out.reshape(-1, n_heads * D), present_k, present_v


def shared_kv_rope_attention(q, k, v, past_k, past_v, total_len, rope, n_heads: int, n_kv_heads: int):
    """Projections q [1, T, H*D], k/v [1, T, KVH*D] before RoPE; rope = (cos, sin [table, D/2], positions [1, T]).

    The op rotates q and k itself: -> ([1, T, H*D], present k, v).
    """
    total = total_len.to(torch.int32)
    return GroupQueryAttention.apply(q, k, v, past_k, past_v, total - 1, total, *rope, n_heads, n_kv_heads)
