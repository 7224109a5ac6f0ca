"""Attention over shared KV buffers from standard ONNX ops: a position computes alike in every call shape.

The same contract as exporters.shared_kv (buffers [B, KVH, capacity, D] written in place at total_len-T..
total_len-1 of each row, RoPE at positions [B, T], causal attention to 0..position of the row's own keys),
without GroupQueryAttention: its one-token path multiplies probabilities by values with a matrix-vector
kernel and its windows with a matrix-matrix one, which round differently (measured here: 2e-7 apart), and
it takes several rows only one token each. Here every call, whatever its rows and tokens, runs the same
kernels on the same numbers: RoPE (com.microsoft RotaryEmbedding, per element), ScatterND into the buffers
(in place when ONNX Runtime binds past and present to one buffer), the keys up to the longest row (Slice),
scores with 3+ query rows per KV head (every query head of a group), masked to each position's own keys
(Where), Softmax, values. Measured here: window rows, one-token steps, rows of a batch (any lengths) and
prompt rows give the same bits, and masked or stale slots change nothing. Targets with quantized
activations need it (a last-bit difference moves an int8 rounding, then a token); drafts keep
GroupQueryAttention (faster at one token, and a draft need not be exact).
"""

from __future__ import annotations

import torch

from mirror_rt.exporters.shared_kv import DOMAIN


class AttentionPlan(torch.autograd.Function):
    """What every layer of a call shares: ScatterND indices [B, KVH, T, 3], the key count L [1] (the longest
    row) and the visibility mask [B, 1, T * rep, L]; its eager forward only gives the tracer shapes."""

    @staticmethod
    def forward(ctx, positions, total_len, n_kv_heads: int, rep: int):
        B, T = positions.shape
        return (torch.zeros(B, n_kv_heads, T, 3, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                torch.zeros(B, 1, T * rep, int(total_len.max()), dtype=torch.bool))

    @staticmethod
    def symbolic(g, positions, total_len, n_kv_heads: int, rep: int):
        const = lambda value: g.op("Constant", value_t=torch.tensor(value, dtype=torch.long))  # noqa: E731
        shape = g.op("Shape", positions)  # [B, T]
        batch, tokens = (g.op("Slice", shape, const([i]), const([i + 1])) for i in (0, 1))
        rows = g.op("Range", const(0), g.op("Squeeze", batch, const([0])), const(1))  # [B]
        heads = const(list(range(n_kv_heads)))
        grid = g.op("Concat", batch, const([n_kv_heads]), tokens, const([1]), axis_i=0)  # [B, KVH, T, 1]
        b = g.op("Expand", g.op("Reshape", rows, const([-1, 1, 1, 1])), grid)
        h = g.op("Expand", g.op("Reshape", heads, const([1, -1, 1, 1])), grid)
        p = g.op("Expand", g.op("Unsqueeze", g.op("Unsqueeze", positions, const([1])), const([3])), grid)
        indices = g.op("Concat", b, h, p, axis_i=3)
        length = g.op("Reshape", g.op("ReduceMax", g.op("Cast", total_len, to_i=7), keepdims_i=0), const([1]))
        keys = g.op("Range", const(0), g.op("Squeeze", length, const([0])), const(1))  # [L]
        visible = g.op("LessOrEqual", keys, g.op("Unsqueeze", positions, const([2])))  # [B, T, L]
        visible = g.op("Unsqueeze", visible, const([1, 3]))  # [B, 1, T, 1, L]
        wide = g.op("Concat", batch, const([1]), tokens, const([rep]), length, axis_i=0)
        flat = g.op("Concat", batch, const([1, -1]), length, axis_i=0)
        mask = g.op("Reshape", g.op("Expand", visible, wide), flat)  # [B, 1, T * rep, L]
        return indices, length, mask


class ExactAttention(torch.autograd.Function):
    """One layer: q [B, T, H*D], k, v [B, T, KVH*D] (before RoPE), buffers [B, KVH, S, D] -> (out [B, T, H*D],
    present k, v: the same buffers); its eager forward only gives the tracer shapes."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, positions, cos, sin, indices, length, mask, n_heads: int,
                n_kv_heads: int, head_dim: int):
        return torch.zeros_like(q), past_k.clone(), past_v.clone()

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, positions, cos, sin, indices, length, mask, n_heads: int,
                 n_kv_heads: int, head_dim: int):
        const = lambda value: g.op("Constant", value_t=torch.tensor(value, dtype=torch.long))  # noqa: E731
        rep = n_heads // n_kv_heads
        rotary = dict(interleaved_i=0)
        q = g.op(f"{DOMAIN}::RotaryEmbedding", q, positions, cos, sin, num_heads_i=n_heads, **rotary)
        k = g.op(f"{DOMAIN}::RotaryEmbedding", k, positions, cos, sin, num_heads_i=n_kv_heads, **rotary)
        by_head = const([0, -1, n_kv_heads, head_dim])  # [B, T, KVH, D] -> [B, KVH, T, D]
        k, v = (g.op("Transpose", g.op("Reshape", x, by_head), perm_i=[0, 2, 1, 3]) for x in (k, v))
        present_k, present_v = g.op("ScatterND", past_k, indices, k), g.op("ScatterND", past_v, indices, v)
        keys = g.op("Slice", present_k, const([0]), length, const([2]))  # [B, KVH, L, D]
        values = g.op("Slice", present_v, const([0]), length, const([2]))
        grouped = g.op("Reshape", q, const([0, -1, n_kv_heads, rep, head_dim]))  # [B, T, KVH, rep, D]
        grouped = g.op("Reshape", g.op("Transpose", grouped, perm_i=[0, 2, 1, 3, 4]), const([0, 0, -1, head_dim]))
        scores = g.op("MatMul", grouped, g.op("Transpose", keys, perm_i=[0, 1, 3, 2]))  # [B, KVH, T*rep, L]
        scores = g.op("Mul", scores, g.op("Constant", value_t=torch.tensor(head_dim ** -0.5, dtype=torch.float32)))
        lowest = g.op("Constant", value_t=torch.tensor(torch.finfo(torch.float32).min))
        probs = g.op("Softmax", g.op("Where", mask, scores, lowest), axis_i=-1)
        out = g.op("MatMul", probs, values)  # [B, KVH, T*rep, D]
        out = g.op("Reshape", out, const([0, 0, -1, rep, head_dim]))  # [B, KVH, T, rep, D]
        out = g.op("Reshape", g.op("Transpose", out, perm_i=[0, 2, 1, 3, 4]), const([0, -1, n_heads * head_dim]))
        out.setType(q.type())
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


def exact_attention_plan(positions, total_len, n_heads: int, n_kv_heads: int) -> tuple:
    """The per-call part every layer shares (AttentionPlan): computed once per graph."""
    return AttentionPlan.apply(positions, total_len, n_kv_heads, n_heads // n_kv_heads)


def exact_rope_attention(q, k, v, past_k, past_v, rope, plan, n_heads: int, n_kv_heads: int, head_dim: int):
    """As exporters.shared_kv.shared_kv_rope_attention (rope = (cos, sin [table, D/2], positions [B, T])), exact
    across call shapes; `plan` from exact_attention_plan."""
    cos, sin, positions = rope
    return ExactAttention.apply(q, k, v, past_k, past_v, positions, cos, sin, *plan, n_heads, n_kv_heads, head_dim)
