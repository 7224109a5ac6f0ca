"""Conversion-ready cuts of a `Transformer` with explicit KV inputs and outputs.

Invariant: positions are `past_len + arange(T)` where past_len is read from the past KV's
shape (dynamic graphs) or from the `position` input (static graphs, fixed-size KV written
in place with a scatter), so a graph run from an empty cache equals the torch model.

`SplitGraph`: the target prefix (returning the exit hidden state, and "exit_hidden" for an attention
adapter), the stateless exit (hidden -> the target's own head -> top-kappa ids and log-probs; its own graph so
target-only decoding never pays for it), the suffix, or the full model (the draft).
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mirror_rt.exporters.exact_kv import GROUPS, GROUPS_INPUT, exact_attention_plan, exact_rope_attention
from mirror_rt.exporters.pool_kv import pool_rope_attention
from mirror_rt.exporters.shared_kv import TOTAL_LEN, shared_kv_rope_attention
from mirror_rt.models.exit_adapter import attends, exit_logits
from mirror_rt.models.transformer import (
    Transformer,
    apply_rope,
    grouped_attention,
    rope_tables,
)

ROLES = ("target_prefix", "target_exit", "target_suffix", "draft")
# Per-layer KV layout of every graph: [batch, kv_heads, positions, head_dim], local layer index (batch 1
# except in shared-KV graphs, whose rows are sequences of a batch).
KV_LAYOUT = "BHTD"
PAST_NAMES = ("past_key.{i}", "past_value.{i}")
PRESENT_NAMES = ("present_key.{i}", "present_value.{i}")
LAST_ROWS = "last_rows"  # int64 [1]: logits rows wanted, counted from the window's end


@dataclass(frozen=True)
class GraphSpec:
    """Which cut of the model a graph computes, and how its shapes behave."""

    role: str  # one of ROLES
    first: int  # first layer (inclusive)
    last: int  # last layer (exclusive)
    kappa: int = 0  # early-exit top-k (target_exit only)
    static: bool = False  # fixed shapes: window padded to `window`, KV of `context` positions
    context: int = 0  # KV positions of a static graph (max_context + max_window)
    window: int = 0  # tokens per call of a static graph
    shared_kv: bool = False  # KV in preallocated buffers written in place (exporters.shared_kv; ONNX Runtime)
    exit_mix: bool = False  # target_prefix also returns "exit_hidden": an attention exit adapter's first stage
    # shared-KV attention from standard ops, alike in every call shape (exporters.exact_kv; targets), else
    # GroupQueryAttention (exporters.shared_kv; drafts: faster at one token)
    exact: bool = False
    pool: bool = False  # exact attention through mirror_rt::PoolAttention (exporters.pool_kv), in place
    kv_half: bool = False  # pool graphs: KV buffers of float16 (ExportConfig.kv_dtype)

    @property
    def takes_groups(self) -> bool:
        """Standard-op exact graphs attend per group of rows (exporters.exact_kv); pool graphs per row."""
        return self.exact and not self.pool

    @property
    def takes_tokens(self) -> bool:
        return self.role in ("target_prefix", "draft")

    @property
    def has_kv(self) -> bool:
        """Every graph but the exit carries KV (the exit is stateless, so it never takes `position`)."""
        return self.role != "target_exit"

    @property
    def n_layers(self) -> int:
        return self.last - self.first

    @property
    def takes_last_rows(self) -> bool:
        """Dynamic logits graphs compute the LM head for the window's last `last_rows` rows only (prefill: 1)."""
        return self.role in ("target_suffix", "draft") and not self.static


def input_names(spec: GraphSpec) -> list[str]:
    """Graph input names, in the order `SplitGraph.forward` takes them."""
    names = ["input_ids" if spec.takes_tokens else "hidden"]
    if spec.static and spec.has_kv:
        names.append("position")
    if spec.takes_last_rows:
        names.append(LAST_ROWS)
    if spec.shared_kv and spec.has_kv:
        names.append(TOTAL_LEN)
        if spec.takes_groups:
            names.append(GROUPS_INPUT)
    return names + kv_names(spec.n_layers, PAST_NAMES)


def output_names(spec: GraphSpec) -> list[str]:
    """Graph output names, in the order `SplitGraph.forward` returns them."""
    head = {"target_prefix": ["hidden"] + (["exit_hidden"] if spec.exit_mix else []),
            "target_exit": ["exit_ids", "exit_logprobs"]}.get(spec.role, ["logits"])
    return head + kv_names(spec.n_layers, PRESENT_NAMES)


def kv_names(n_layers: int, pattern: tuple[str, str]) -> list[str]:
    """[key0, value0, key1, value1, ...] names for `n_layers` local layers."""
    return [p.format(i=i) for i in range(n_layers) for p in pattern]


def state_pairs(spec: GraphSpec) -> dict[str, str]:
    """past -> present name pairs, one per KV tensor (the stateful transformation's map)."""
    past, present = kv_names(spec.n_layers, PAST_NAMES), kv_names(spec.n_layers, PRESENT_NAMES)
    return dict(zip(past, present))


class ExitAdaptedTarget(nn.Module):
    """A target as the graph exporters see it, plus a trained early exit; shares every weight of `model`."""

    def __init__(self, model: Transformer, exit_adapter):
        super().__init__()
        self.target, self.exit_adapter, self.config = model, exit_adapter, model.config
        self.embed_tokens, self.layers = model.embed_tokens, model.layers
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed(tokens)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.target.logits(h)


def mixes_exit(model) -> bool:
    """True when `model` carries an attention exit adapter, whose first stage the prefix graph computes."""
    return attends(getattr(model, "exit_adapter", None))


def with_exit_adapter(model: Transformer, exit_adapter) -> nn.Module:
    """`model` whose target_exit graph computes the early exit through `exit_adapter` (None: `model`)."""
    if exit_adapter is None:
        return model
    p = model.embed_tokens.weight
    return ExitAdaptedTarget(model, exit_adapter.to(device=p.device, dtype=p.dtype).eval())


class SplitGraph(nn.Module):
    """Layers first..last-1 of `model` as a traceable function with explicit KV.

    Shared-KV graphs are batched: ids [B, T] (or hidden [B, T, hidden]) over KV buffers [B, KVH, S, D]
    with `total_len` [B], each row a sequence of its own length (exporters.shared_kv: one token per row
    when B > 1). Explicit-KV and static graphs take one sequence: ids [T] over KV [1, KVH, S, D].

    Limitations:
    - explicit-KV and static graphs: batch size 1; a prefix graph with an attention exit adapter
      (`exit_mix`) too (its first stage reads row 0's keys);
    - the RoPE cos/sin tables cover `table_len` positions (the bundle's context limit).
    """

    def __init__(self, model: Transformer, spec: GraphSpec, table_len: int):
        super().__init__()
        c = model.config
        self.model, self.spec = model, spec
        self.exit_adapter = getattr(model, "exit_adapter", None)  # set by with_exit_adapter
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        cos, sin = rope_tables(model.inv_freq, torch.arange(table_len), model.embed_tokens.weight.dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.shared = spec.shared_kv and spec.has_kv
        if self.shared:
            # RoPE inside the attention op (half tables), projections reading the same input fused (q|k|v,
            # gate|up), so a layer is ~12 nodes
            half = self.head_dim // 2
            self.register_buffer("rope_cos_half", self.rope_cos[:, :half].contiguous(), persistent=False)
            self.register_buffer("rope_sin_half", self.rope_sin[:, :half].contiguous(), persistent=False)
            layers = [model.layers[spec.first + i] for i in range(spec.n_layers)]
            self.qkv = nn.ModuleList(_side_by_side(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj)
                                     for b in layers)
            self.gate_up = nn.ModuleList(_side_by_side(b.mlp.gate_proj, b.mlp.up_proj) for b in layers)

    def forward(self, x, *rest):
        spec = self.spec
        if not spec.has_kv:
            return self._exit(x)
        if self.shared:
            last_rows, rest = (rest[0], rest[1:]) if spec.takes_last_rows else (None, rest)
            groups, kv = (rest[1], rest[2:]) if spec.takes_groups else (None, rest[1:])
            return self._shared_layers(x, kv, rest[0], last_rows, groups)
        if spec.static:
            position, kv = rest[0], rest[1:]
            positions = position.reshape(1) + torch.arange(spec.window, dtype=torch.long)
        else:
            last_rows, kv = (rest[0], rest[1:]) if spec.takes_last_rows else (None, rest)
            positions = torch.arange(x.shape[0], dtype=torch.long) + kv[0].shape[2]
        h = self.model.embed(x) if spec.takes_tokens else x
        cos = torch.index_select(self.rope_cos, 0, positions)  # [T, head_dim]
        sin = torch.index_select(self.rope_sin, 0, positions)
        mask = self._mask(positions, kv[0].shape[2] + (0 if spec.static else x.shape[0]))
        presents = []
        for i in range(spec.n_layers):
            block = self.model.layers[spec.first + i]
            h, k, v = self._block(block, h, (cos, sin), kv[2 * i], kv[2 * i + 1], mask, positions)
            presents += [k, v]
        return (*self._head(h, None if spec.static else last_rows, presents, positions), *presents)

    def _shared_layers(self, x, kv, total_len, last_rows, groups) -> tuple:
        """The layers of a batched shared-KV graph: x [B, T] ids or [B, T, hidden] over buffers [B, KVH, S, D];
        exact graphs attend per group of rows (`groups` [GROUPS, 2], exporters.exact_kv)."""
        B, T = x.shape[0], x.shape[1]
        positions = total_len.to(torch.long).unsqueeze(1) - T + torch.arange(T, dtype=torch.long)  # [B, T]
        rope = (self.rope_cos_half, self.rope_sin_half, positions)
        sizes = [self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2
        h = self.model.embed(x) if self.spec.takes_tokens else x
        plan = None  # what every layer of a standard-op exact graph's call shares (exporters.exact_kv)
        if self.spec.takes_groups:
            plan = exact_attention_plan(positions, groups, self.n_heads, self.n_kv_heads)
        presents = []
        for i in range(self.spec.n_layers):
            block = self.model.layers[self.spec.first + i]
            attn = block.self_attn
            q, k, v = self.qkv[i](block.input_layernorm(h)).split(sizes, dim=-1)
            if attn.qk_norm:  # per head, before RoPE
                q = attn.q_norm(q.reshape(B, T, self.n_heads, self.head_dim)).reshape(B, T, -1)
                k = attn.k_norm(k.reshape(B, T, self.n_kv_heads, self.head_dim)).reshape(B, T, -1)
            if self.spec.pool:
                out, keys, values = pool_rope_attention(q, k, v, kv[2 * i], kv[2 * i + 1], rope, self.n_heads,
                                                        self.n_kv_heads)
            elif plan is not None:
                out, keys, values = exact_rope_attention(q, k, v, kv[2 * i], kv[2 * i + 1], rope, plan, self.n_heads,
                                                         self.n_kv_heads, self.head_dim)
            else:
                out, keys, values = shared_kv_rope_attention(q, k, v, kv[2 * i], kv[2 * i + 1], total_len, rope,
                                                             self.n_heads, self.n_kv_heads)
            h = h + attn.o_proj(out)
            gate, up = self.gate_up[i](block.post_attention_layernorm(h)).split([block.mlp.up_proj.out_features] * 2,
                                                                                dim=-1)
            h = h + block.mlp.down_proj(F.silu(gate) * up)
            presents += [keys, values]
        if self.spec.role == "target_prefix":
            return (*self._head(h, None, presents, positions), *presents)
        if last_rows is not None:  # the LM head over the last rows only (prefill needs one)
            h = h[:, T - last_rows[0]:]
        return (self.model.logits(h), *presents)

    def _mask(self, positions: torch.Tensor, n_keys) -> torch.Tensor:
        """[T, S] bool: query at position p sees keys 0..p."""
        keys = torch.arange(n_keys, dtype=torch.long)
        return keys[None, :] <= positions[:, None]

    def _head(self, h: torch.Tensor, last_rows: torch.Tensor | None, presents: list, positions) -> tuple:
        if self.spec.role == "target_prefix":
            if not self.spec.exit_mix:
                return (h,)
            if self.shared:  # batch 1: the adapter's first stage reads row 0
                return h, self._exit_mix(h[0], presents[-2], presents[-1], positions[0]).unsqueeze(0)
            return h, self._exit_mix(h, presents[-2], presents[-1], positions)
        if last_rows is not None:  # the LM head over the last rows only (prefill needs one)
            h = h[h.shape[0] - last_rows[0]:]
        return (self.model.logits(h),)

    def _exit_mix(self, h, keys, values, positions) -> torch.Tensor:
        """The attention adapter's first stage over the last prefix layer's keys/values [1, KVH, S, D].

        Key slots past a query's position are masked, so stale slots of a shared or static buffer never count.
        """
        rope = (torch.index_select(self.rope_cos, 0, positions), torch.index_select(self.rope_sin, 0, positions))
        return self.exit_adapter.mix(h, keys[0].float(), values[0].float(), rope, self._mask(positions, keys.shape[2]))

    def _exit(self, h: torch.Tensor) -> tuple:
        """Exit hidden h [T, hidden] (an attention adapter's first stage when it has one) -> top-kappa
        (ids [T, kappa] int64, log-probs [T, kappa])."""
        mixed = attends(self.exit_adapter)
        logprobs = F.log_softmax(exit_logits(self.model, h, self.exit_adapter, mixed).float(), dim=-1)  # [T, vocab]
        values, ids = torch.topk(logprobs, self.spec.kappa, dim=-1)  # [T, kappa] each
        return ids, values

    def _block(self, block, x, rope, past_k, past_v, mask, positions):
        """One decoder block over explicit KV; returns (x, present_k, present_v)."""
        attn = block.self_attn
        y = block.input_layernorm(x)
        q = attn.q_proj(y).reshape(-1, self.n_heads, self.head_dim).transpose(0, 1)  # [H, T, D]
        k = attn.k_proj(y).reshape(-1, self.n_kv_heads, self.head_dim).transpose(0, 1)  # [KVH, T, D]
        v = attn.v_proj(y).reshape(-1, self.n_kv_heads, self.head_dim).transpose(0, 1)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        keys, values = self._write(past_k, k, positions), self._write(past_v, v, positions)
        out = grouped_attention(q, keys[0], values[0], mask)  # [T, H*D]
        x = x + attn.o_proj(out)
        x = x + block.mlp(block.post_attention_layernorm(x))
        return x, keys, values

    def _write(self, past: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append (dynamic) or scatter at `positions` (static) new [KVH, T, D] into past [1, KVH, S, D]."""
        if not self.spec.static:
            return torch.cat((past, new.unsqueeze(0)), dim=2)
        index = positions.reshape(1, 1, -1, 1).expand(1, self.n_kv_heads, -1, self.head_dim)
        return torch.scatter(past, 2, index, new.unsqueeze(0))


def _side_by_side(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the given Linears' outputs concatenated (same input)."""
    first = linears[0]
    bias = first.bias is not None
    fused = nn.Linear(first.in_features, sum(x.out_features for x in linears), bias=bias,
                      dtype=first.weight.dtype, device=first.weight.device)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([x.weight for x in linears]))
        if bias:
            fused.bias.copy_(torch.cat([x.bias for x in linears]))
    return fused


def graph_spec(role: str, n_layers: int, exit_layer: int, kappa: int, static: bool = False,
               context: int = 0, window: int = 0, shared_kv: bool = False, exit_mix: bool = False,
               pool: bool = False, kv_half: bool = False) -> GraphSpec:
    """The spec of `role` for a model of `n_layers` cut at `exit_layer` (`exit_mix`, `pool`, `kv_half`: see
    GraphSpec)."""
    first, last = {"target_prefix": (0, exit_layer), "target_exit": (exit_layer, exit_layer),
                   "target_suffix": (exit_layer, n_layers), "draft": (0, n_layers)}[role]
    shared = shared_kv and role != "target_exit"
    return GraphSpec(role, first, last, kappa if role == "target_exit" else 0, static, context, window, shared,
                     exit_mix and role == "target_prefix", exact=shared and role != "draft",
                     pool=pool and shared and role != "draft", kv_half=kv_half and pool and shared and role != "draft")


def example_inputs(model: Transformer, spec: GraphSpec, tokens: int = 3, past: int = 2) -> tuple:
    """Tracing inputs: a short window over a short (dynamic) or full-size (static) past (none for the exit)."""
    c = model.config
    dtype = model.embed_tokens.weight.dtype
    T = spec.window if spec.static else tokens
    x = (torch.arange(T, dtype=torch.long) % c.vocab_size if spec.takes_tokens
         else torch.randn(T, c.hidden_size, dtype=dtype))
    if not spec.has_kv:
        return (x,)
    if spec.shared_kv:  # batched: two rows of different lengths
        return _shared_example(model, spec, x, past)
    length = spec.context if spec.static else past  # static graphs hold the whole context
    kv = [torch.zeros(1, c.n_kv_heads, length, c.head_dim, dtype=dtype) for _ in range(2 * spec.n_layers)]
    head = [x, torch.tensor([past], dtype=torch.long)] if spec.static else [x]
    if spec.takes_last_rows:
        head.append(torch.tensor([T], dtype=torch.long))
    return tuple(head + kv)


def _shared_example(model: Transformer, spec: GraphSpec, x: torch.Tensor, past: int) -> tuple:
    """Tracing inputs of a batched shared-KV graph: x as two rows, buffers with room, total_len per row."""
    c, T = model.config, x.shape[0]
    dtype = model.embed_tokens.weight.dtype
    x = torch.stack((x, x))  # [2, T] or [2, T, hidden]
    kv_dtype = torch.float16 if spec.kv_half else dtype
    kv = [torch.zeros(2, c.n_kv_heads, past + T + 2, c.head_dim, dtype=kv_dtype) for _ in range(2 * spec.n_layers)]
    head = [x, torch.tensor([T], dtype=torch.long)] if spec.takes_last_rows else [x]
    head.append(torch.tensor([past + T, past + T + 1], dtype=torch.int32))
    if spec.takes_groups:  # a group per row, then empty groups
        head.append(torch.tensor([[1, past + T], [2, past + T + 1]] + [[2, 1]] * (GROUPS - 2), dtype=torch.long))
    return tuple(head + kv)
