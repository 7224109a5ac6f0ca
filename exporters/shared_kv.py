"""Attention over shared, preallocated KV buffers written in place: onnxruntime's GroupQueryAttention.

Graphs exported with `shared_kv` take each layer's past key/value as a [B, kv_heads, capacity,
head_dim] buffer (a row per sequence) and `total_len` [B] (positions each row holds after this call);
the op writes each row's new keys and values in place at total_len-T..total_len-1, rotates q and k
(RoPE at explicit positions [B, T]) and attends causally to 0..total_len-1 of its own row. ONNX
Runtime binds past and present to the same buffer (IO binding), so a call copies no cache and a
rollback is only a smaller `total_len` next time. Measured here: the explicit-KV graphs spent a
quarter of a draft forward at 800 positions concatenating caches.
Limitation (ONNX Runtime's CPU kernel): a call over several rows takes one new token per row (T = 1);
windows of more tokens run one row per call. The other contrib ops that take batches of windows were
measured and set aside: SparseAttention's CPU kernel reads its softmax rows at offsets of each row's
own length but writes them at the batch maximum's (rows of different lengths come out wrong), and
the standard Attention op over TensorScatter buffers costs time in proportion to the buffer capacity.
Only ONNX Runtime runs these graphs (CPU and CUDA providers implement the op); OpenVINO does not.
Drafts (and SS drafts) attend through it; targets through exporters.exact_kv, whose positions come out alike in
every call shape (this op's one-token path rounds differently from its windows).
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
