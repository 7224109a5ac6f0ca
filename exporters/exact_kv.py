"""Attention over shared KV buffers from standard ONNX ops: a position computes alike in every call shape.

The contract of exporters.shared_kv (buffers [B, KVH, capacity, D] written in place at total_len-T..,
RoPE at positions [B, T], causal attention to the row's own keys) in standard ops that run the same kernels on the
same numbers whatever the call's rows and tokens. Format 6 takes `attention_groups` [GROUPS, 2] (each group's row
end and the keys it reads; the caller picks the cut: runtime.batch.splits.cheapest_groups).
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import torch

from mirror_rt.exporters.shared_kv import DOMAIN

GROUPS = 4  # attention groups of rows per call
GROUPS_INPUT = "attention_groups"  # int64 [GROUPS, 2]: (row end, keys read) per group of contiguous rows
PER_GROUP = 5  # plan tensors per group: KV starts, KV ends, query start, query end, mask


def _const(g, value):
    return g.op("Constant", value_t=torch.tensor(value, dtype=torch.long))


class AttentionPlan(torch.autograd.Function):
    """What every layer of a call shares: ScatterND indices [B, KVH, T, 3], then per group of rows its KV slice
    bounds (starts [2], ends [2] over axes batch and position), its query rows (start [1], end [1]) and its
    additive mask [rows, 1, T * rep, keys] (0 where a position sees the key, the lowest float elsewhere); its
    eager forward only gives the tracer shapes."""

    @staticmethod
    def forward(ctx, positions, groups, n_kv_heads: int, rep: int):
        B, T = positions.shape
        out = [torch.zeros(B, n_kv_heads, T, 3, dtype=torch.long)]
        first = 0
        for end, keys in groups.tolist():
            bounds = [torch.zeros(size, dtype=torch.long) for size in (2, 2, 1, 1)]  # distinct: the tracer
            queries = T * rep if rep > 1 else T  # a traced `T * 1` is folded away, and the exporter then fails
            out += bounds + [torch.zeros(end - first, 1, queries, keys, dtype=torch.float32)]
            first = end
        return tuple(out)

    @staticmethod
    def symbolic(g, positions, groups, n_kv_heads: int, rep: int):
        const = lambda value: _const(g, value)  # noqa: E731
        shape = g.op("Shape", positions)  # [B, T]
        batch, tokens = (g.op("Slice", shape, const([i]), const([i + 1])) for i in (0, 1))
        rows = g.op("Range", const(0), g.op("Squeeze", batch, const([0])), const(1))  # [B]
        heads = const(list(range(n_kv_heads)))
        grid = g.op("Concat", batch, const([n_kv_heads]), tokens, const([1]), axis_i=0)  # [B, KVH, T, 1]
        b = g.op("Expand", g.op("Reshape", rows, const([-1, 1, 1, 1])), grid)
        h = g.op("Expand", g.op("Reshape", heads, const([1, -1, 1, 1])), grid)
        p = g.op("Expand", g.op("Unsqueeze", g.op("Unsqueeze", positions, const([1])), const([3])), grid)
        out = [g.op("Concat", b, h, p, axis_i=3)]
        row_ends = g.op("Reshape", g.op("Slice", groups, const([0]), const([1]), const([1])), const([-1]))  # [G]
        starts = g.op("Concat", const([0]), row_ends, axis_i=0)  # [G + 1]: where each group starts, then B
        for i in range(GROUPS):
            out += _group_plan(g, positions, groups, starts, i, tokens, rep)
        return tuple(out)


def _group_plan(g, positions, groups, starts, i: int, tokens, rep: int) -> list:
    """Group i's part of the plan: KV starts and ends [2] (rows, positions), query rows start and end [1], mask."""
    const = lambda value: _const(g, value)  # noqa: E731
    start, end = (g.op("Reshape", g.op("Slice", starts, const([j]), const([j + 1])), const([1])) for j in (i, i + 1))
    length = g.op("Reshape", g.op("Slice", groups, const([i, 1]), const([i + 1, 2]), const([0, 1])), const([1]))
    keys = g.op("Range", const(0), g.op("Squeeze", length, const([0])), const(1))  # [L]
    own = g.op("Slice", positions, start, end, const([0]))  # [n, T]
    visible = g.op("LessOrEqual", keys, g.op("Unsqueeze", own, const([2])))  # [n, T, L]
    lowest = g.op("Constant", value_t=torch.tensor(torch.finfo(torch.float32).min))
    zero = g.op("Constant", value_t=torch.tensor(0.0))
    bias = g.op("Where", g.op("Unsqueeze", visible, const([1, 3])), zero, lowest)  # [n, 1, T, 1, L]
    n = g.op("Sub", end, start)
    wide = g.op("Concat", n, const([1]), tokens, const([rep]), length, axis_i=0)
    queries = g.op("Mul", tokens, const([rep]))
    flat = g.op("Concat", n, const([1]), queries, length, axis_i=0)  # no -1: a group may be empty
    mask = g.op("Reshape", g.op("Expand", bias, wide), flat)  # [n, 1, T * rep, L]
    return [g.op("Concat", start, const([0]), axis_i=0), g.op("Concat", end, length, axis_i=0), start, end, mask]


class ExactAttention(torch.autograd.Function):
    """One layer: q [B, T, H*D], k, v [B, T, KVH*D] (before RoPE), buffers [B, KVH, S, D] -> (out [B, T, H*D],
    present k, v: the same buffers); `plan` as AttentionPlan gives it. Its eager forward only gives the tracer
    shapes."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, positions, cos, sin, n_heads: int, n_kv_heads: int, head_dim: int,
                *plan):
        return torch.zeros_like(q), past_k.clone(), past_v.clone()

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, positions, cos, sin, n_heads: int, n_kv_heads: int, head_dim: int,
                 *plan):
        const = lambda value: _const(g, value)  # noqa: E731
        rep = n_heads // n_kv_heads
        rotary = dict(interleaved_i=0)
        q = g.op(f"{DOMAIN}::RotaryEmbedding", q, positions, cos, sin, num_heads_i=n_heads, **rotary)
        k = g.op(f"{DOMAIN}::RotaryEmbedding", k, positions, cos, sin, num_heads_i=n_kv_heads, **rotary)
        by_head = const([0, -1, n_kv_heads, head_dim])  # [B, T, KVH, D] -> [B, KVH, T, D]
        k, v = (g.op("Transpose", g.op("Reshape", x, by_head), perm_i=[0, 2, 1, 3]) for x in (k, v))
        indices, groups = plan[0], plan[1:]
        present_k, present_v = g.op("ScatterND", past_k, indices, k), g.op("ScatterND", past_v, indices, v)
        grouped = g.op("Reshape", q, const([0, -1, n_kv_heads, rep, head_dim]))  # [B, T, KVH, rep, D]
        grouped = g.op("Reshape", g.op("Transpose", grouped, perm_i=[0, 2, 1, 3, 4]), const([0, 0, -1, head_dim]))
        scale = g.op("Constant", value_t=torch.tensor(head_dim ** -0.5, dtype=torch.float32))
        outs = []
        for i in range(0, len(groups), PER_GROUP):  # each group of rows reads the keys of its own longest row
            kv_starts, kv_ends, first, last, mask = groups[i:i + PER_GROUP]
            keys = g.op("Slice", present_k, kv_starts, kv_ends, const([0, 2]))  # [n, KVH, L, D]
            values = g.op("Slice", present_v, kv_starts, kv_ends, const([0, 2]))
            queries = g.op("Slice", grouped, first, last, const([0]))  # [n, KVH, T*rep, D]
            scores = g.op("Mul", g.op("MatMul", queries, g.op("Transpose", keys, perm_i=[0, 1, 3, 2])), scale)
            probs = g.op("Softmax", g.op("Add", scores, mask), axis_i=-1)  # masked: x + lowest == lowest
            outs.append(g.op("MatMul", probs, values))  # [n, KVH, T*rep, D]
        out = g.op("Concat", *outs, axis_i=0)  # [B, KVH, T*rep, D]
        out = g.op("Reshape", out, const([0, 0, -1, rep, head_dim]))  # [B, KVH, T, rep, D]
        out = g.op("Reshape", g.op("Transpose", out, perm_i=[0, 2, 1, 3, 4]), const([0, -1, n_heads * head_dim]))
        out.setType(q.type())
        present_k.setType(past_k.type())
        present_v.setType(past_v.type())
        return out, present_k, present_v


def exact_attention_plan(positions, groups, n_heads: int, n_kv_heads: int) -> tuple:
    """The per-call part every layer shares (AttentionPlan): computed once per graph; `groups` [GROUPS, 2]."""
    return AttentionPlan.apply(positions, groups, n_kv_heads, n_heads // n_kv_heads)


def exact_rope_attention(q, k, v, past_k, past_v, rope, plan, n_heads: int, n_kv_heads: int, head_dim: int):
    """As exporters.shared_kv.shared_kv_rope_attention (rope = (cos, sin [table, D/2], positions [B, T])), exact
    across call shapes; `plan` from exact_attention_plan."""
    cos, sin, positions = rope
    return ExactAttention.apply(q, k, v, past_k, past_v, positions, cos, sin, n_heads, n_kv_heads, head_dim, *plan)
