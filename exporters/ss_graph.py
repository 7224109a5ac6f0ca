"""ONNX export of a Speculative Streaming draft (`models.ss_draft.StreamDraft`).

`StreamDraftGraph` (explicit KV) and `SharedStreamDraftGraph` (exporters.shared_kv): outputs `logits` and
`stream_logits` [R, n_s, vocab] for the window's last R = `last_rows` positions. A stream row never influences a main
row, so the main logits and the KV are the plain draft graph's; stream keys never enter the KV.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mirror_rt.exporters.shared_kv import DOMAIN, TOTAL_LEN, shared_kv_rope_attention
from mirror_rt.exporters.split import (
    LAST_ROWS,
    PAST_NAMES,
    PRESENT_NAMES,
    SplitGraph,
    graph_spec,
    kv_names,
)
from mirror_rt.models.ss_draft import stream_qkv
from mirror_rt.models.transformer import apply_rope

STREAM_LOGITS = "stream_logits"
N_STREAMS = "n_streams"  # model metadata: lookahead streams of the graph
LORA = re.compile(r"/(q|v|down)/(a|b)(_\d+)?/MatMul")  # traced names of the streams' low-rank products


class StreamDraftGraph(nn.Module):
    """A StreamDraft's forward_streams over explicit KV (see the module docstring)."""

    def __init__(self, draft, table_len: int):
        super().__init__()
        base = draft.base
        self.draft, self.n_streams, self.first = draft, draft.n_streams, draft.first
        self.plain = SplitGraph(base, graph_spec("draft", base.config.n_layers, 0, 0), table_len)
        c = base.config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim

    def forward(self, input_ids, last_rows, *kv):
        plain, S = self.plain, self.n_streams
        T, start = input_ids.shape[0], kv[0].shape[2]
        positions = torch.arange(T, dtype=torch.long) + start
        h = self.draft.base.embed(input_ids)
        rope = (torch.index_select(plain.rope_cos, 0, positions), torch.index_select(plain.rope_sin, 0, positions))
        mask = plain._mask(positions, start + T)
        presents = []
        for i in range(self.first):
            h, k, v = plain._block(self.draft.base.layers[i], h, rope, kv[2 * i], kv[2 * i + 1], mask, positions)
            presents += [k, v]
        rows = T - last_rows[0]  # main rows before the streamed positions
        s = h[rows:, None, :] + self.draft.stream_embed[None].to(h.dtype)  # [R, S, hidden]
        stream_positions = (positions[rows:, None] + 1 + torch.arange(S)[None]).reshape(-1)
        for i in range(self.first, self.draft.config.n_layers):
            h, s, k, v = self._block(i, h, s, kv[2 * i], kv[2 * i + 1], positions, stream_positions, rows)
            presents += [k, v]
        R = s.shape[0]
        logits = self.draft.base.logits(torch.cat([h[rows:], s.reshape(R * S, -1)]))  # one LM-head product
        return logits[:R], logits[R:].reshape(R, S, -1), *presents

    def _block(self, i: int, h, s, past_k, past_v, positions, stream_positions, rows):
        """Layer i over main rows h [T, hidden] and stream rows s [R, S, hidden]; returns (h, s, keys, values)."""
        layer, extra = self.draft.base.layers[i], self.draft.stream_layers[i - self.first]
        attn, mlp = layer.self_attn, layer.mlp
        T, R, S = h.shape[0], s.shape[0], self.n_streams
        x = torch.cat([layer.input_layernorm(h), layer.input_layernorm(s).reshape(R * S, -1)])
        q, k, v = stream_qkv(attn, extra, x, T, self.draft.config)
        every = torch.cat([positions, stream_positions])
        cos = torch.index_select(self.plain.rope_cos, 0, every)
        sin = torch.index_select(self.plain.rope_sin, 0, every)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys = torch.cat((past_k, k[:, :T].unsqueeze(0)), dim=2)  # the cache holds main keys only
        values = torch.cat((past_v, v[:, :T].unsqueeze(0)), dim=2)
        all_keys = torch.cat((keys, k[:, T:].unsqueeze(0)), dim=2)
        all_values = torch.cat((values, v[:, T:].unsqueeze(0)), dim=2)
        mask = graph_stream_mask(positions, keys.shape[2], rows, S)
        rep = self.n_heads // self.n_kv_heads
        grouped = q.reshape(1, self.n_kv_heads, rep * q.shape[1], self.head_dim)
        out = F.scaled_dot_product_attention(grouped, all_keys, all_values, attn_mask=mask.repeat(rep, 1))
        out = attn.o_proj(out.reshape(self.n_heads, -1, self.head_dim).transpose(0, 1).reshape(T + R * S, -1))
        h, s = h + out[:T], s + out[T:].reshape(R, S, -1)
        x = torch.cat([layer.post_attention_layernorm(h), layer.post_attention_layernorm(s).reshape(R * S, -1)])
        inner = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)  # main and stream rows share each product
        out = mlp.down_proj(inner)
        return h + out[:T], s + (out[T:] + extra.down(inner[T:])).reshape(R, S, -1), keys, values


class SharedStreamDraftGraph(StreamDraftGraph):
    """A StreamDraft's forward_streams over shared KV buffers (see the module docstring)."""

    def __init__(self, draft, table_len: int):
        super().__init__(draft, table_len)
        n = draft.config.n_layers
        self.plain = SplitGraph(draft.base, graph_spec("draft", n, 0, 0, shared_kv=True), table_len)
        if draft.config.qk_norm:  # the plain graph's fused projections (q|k|v) carry no per-head norms here
            raise ValueError("shared-KV SS graphs need a family without q/k norms (use --kv explicit)")

    def forward(self, input_ids, last_rows, total_len, *kv):
        plain, base, S = self.plain, self.draft.base, self.n_streams
        T = input_ids.shape[0]
        positions = torch.arange(T, dtype=torch.long) + (total_len.to(torch.long) - T)
        rope = (plain.rope_cos_half, plain.rope_sin_half, positions.unsqueeze(0))
        h = base.embed(input_ids).unsqueeze(0)  # [1, T, hidden] as in the plain fused graph
        presents = []
        for i in range(self.first):
            h, k, v = self._main_attention(i, h, kv, total_len, rope)
            h = self._main_mlp(i, h)
            presents += [k, v]
        rows = T - last_rows[0]
        s = h[0, rows:, None, :] + self.draft.stream_embed[None].to(h.dtype)  # [R, S, hidden]
        stream_positions = (positions[rows:, None] + 1 + torch.arange(S)[None]).reshape(-1)
        for i in range(self.first, self.draft.config.n_layers):
            h, s, k, v = self._joint_attention(i, h, s, kv, total_len, rope, stream_positions, rows)
            h, s = self._joint_mlp(i, h, s)
            presents += [k, v]
        R = s.shape[0]
        logits = base.logits(torch.cat([h[0, rows:], s.reshape(R * S, -1)]))
        return logits[:R], logits[R:].reshape(R, S, -1), *presents

    def _main_attention(self, i: int, h, kv, total_len, rope):
        """Main rows of layer i through GroupQueryAttention (keys written in place): (h, keys, values)."""
        block = self.draft.base.layers[i]
        q, k, v = self.plain.qkv[i](block.input_layernorm(h)).split(self._qkv_sizes(), dim=-1)
        out, keys, values = shared_kv_rope_attention(q, k, v, kv[2 * i], kv[2 * i + 1], total_len, rope,
                                                     self.n_heads, self.n_kv_heads)
        return h + block.self_attn.o_proj(out), keys, values

    def _main_mlp(self, i: int, h):
        block = self.draft.base.layers[i]
        gate, up = self.plain.gate_up[i](block.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + block.mlp.down_proj(F.silu(gate) * up)

    def _joint_attention(self, i: int, h, s, kv, total_len, rope, stream_positions, rows):
        """Layer i's attention for main rows h [1, T, hidden] (GroupQueryAttention, keys written in place) and
        stream rows s [R, S, hidden], one q|k|v and one output product for both: (h, s, keys, values)."""
        block, extra = self.draft.base.layers[i], self.draft.stream_layers[i - self.first]
        T, R, S = h.shape[1], s.shape[0], self.n_streams
        x = torch.cat([block.input_layernorm(h)[0], block.input_layernorm(s).reshape(R * S, -1)])
        qkv = self.plain.qkv[i](x)
        q, k, v = qkv[:T].unsqueeze(0).split(self._qkv_sizes(), dim=-1)
        main, keys, values = shared_kv_rope_attention(q, k, v, kv[2 * i], kv[2 * i + 1], total_len, rope,
                                                      self.n_heads, self.n_kv_heads)
        q, k, v = qkv[T:].split(self._qkv_sizes(), dim=-1)
        streams = self._stream_attention(q + extra.q(x[T:]), k, v + extra.v(x[T:]), keys, values,
                                         rope[2][0], stream_positions, rows, total_len)
        out = block.self_attn.o_proj(torch.cat([main[0], streams]))
        return h + out[:T].unsqueeze(0), s + out[T:].reshape(R, S, -1), keys, values

    def _stream_attention(self, q, k, v, keys, values, positions, stream_positions, rows, total_len):
        """Stream rows' projections q [R*S, H*D], k/v [R*S, KVH*D] (before RoPE) over the buffer's first
        total_len keys and their own position's streams -> [R*S, H*D]."""
        D, rows_s = self.head_dim, q.shape[0]
        cos = torch.index_select(self.plain.rope_cos, 0, stream_positions)
        sin = torch.index_select(self.plain.rope_sin, 0, stream_positions)
        q = apply_rope(q.reshape(-1, self.n_heads, D).transpose(0, 1), cos, sin)  # [H, R*S, D]
        k = apply_rope(k.reshape(-1, self.n_kv_heads, D).transpose(0, 1), cos, sin)
        v = v.reshape(-1, self.n_kv_heads, D).transpose(0, 1)
        n = total_len.to(torch.long)[0]
        all_keys = torch.cat((keys[:, :, :n], k.unsqueeze(0)), dim=2)  # the op stored the main keys rotated
        all_values = torch.cat((values[:, :, :n], v.unsqueeze(0)), dim=2)
        mask = graph_stream_mask(positions, n, rows, self.n_streams)[positions.shape[0]:]  # the stream rows
        rep = self.n_heads // self.n_kv_heads
        grouped = q.reshape(1, self.n_kv_heads, rep * rows_s, D)
        out = F.scaled_dot_product_attention(grouped, all_keys, all_values, attn_mask=mask.repeat(rep, 1))
        return out.reshape(self.n_heads, rows_s, D).transpose(0, 1).reshape(rows_s, -1)

    def _joint_mlp(self, i: int, h, s):
        """Layer i's MLP over main rows h [1, T, hidden] and stream rows s [R, S, hidden] in one product each."""
        block, extra = self.draft.base.layers[i], self.draft.stream_layers[i - self.first]
        T, R, S = h.shape[1], s.shape[0], self.n_streams
        x = torch.cat([block.post_attention_layernorm(h)[0], block.post_attention_layernorm(s).reshape(R * S, -1)])
        gate, up = self.plain.gate_up[i](x).chunk(2, dim=-1)
        inner = F.silu(gate) * up
        out = block.mlp.down_proj(inner)
        return h + out[:T].unsqueeze(0), s + (out[T:] + extra.down(inner[T:])).reshape(R, S, -1)

    def _qkv_sizes(self) -> list[int]:
        return [self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2


def graph_stream_mask(positions: torch.Tensor, n_keys, rows, S: int) -> torch.Tensor:
    """[T + R*S, start + T + R*S] bool, built from comparisons only (traceable with dynamic T, R).

    As `models.ss_draft.stream_mask`, for streams of the last R = T - rows positions: main rows
    are causal over the cache and the window; stream j of position p sees keys <= p and the
    streams of p with index <= j.
    """
    T = positions.shape[0]
    key_pos = torch.arange(n_keys, dtype=torch.long)  # the cache's and the window's main keys
    stream_of = positions[rows:].repeat_interleave(S)  # [R*S] position of each stream row
    index = torch.arange(stream_of.shape[0], dtype=torch.long) % S
    prefix = key_pos[None, :] <= torch.cat([positions, stream_of])[:, None]  # [T + R*S, start + T]
    main_to_streams = torch.zeros(T, stream_of.shape[0], dtype=torch.bool)
    same = (stream_of[:, None] == stream_of[None, :]) & (index[None, :] <= index[:, None])
    return torch.cat([prefix, torch.cat([main_to_streams, same])], dim=1)


def export_stream_draft(draft, table_len: int, weights: str, path: Path, shared: bool) -> list[Path]:
    """Write `path` (.onnx): the SS draft graph over shared KV buffers or explicit KV, weights fp32 or
    weight-only int8/int4/q4_1 (the base's products; the small stream LoRA products stay fp32)."""
    from mirror_rt.exporters.onnx import OPSET, WEIGHTS, quantize_weights

    if weights not in WEIGHTS:
        raise ValueError(f"--format onnx supports weights {', '.join(WEIGHTS)}, not '{weights}'")
    c = draft.config
    graph = (SharedStreamDraftGraph if shared else StreamDraftGraph)(draft, table_len).eval()
    ins = ["input_ids", LAST_ROWS] + ([TOTAL_LEN] if shared else []) + kv_names(c.n_layers, PAST_NAMES)
    outs = ["logits", STREAM_LOGITS] + kv_names(c.n_layers, PRESENT_NAMES)
    dtype = draft.base.embed_tokens.weight.dtype
    T, past_len = 3, 2
    buffer = past_len + T + 1 if shared else past_len  # shared: a buffer with room to spare
    past = [torch.zeros(1, c.n_kv_heads, buffer, c.head_dim, dtype=dtype) for _ in range(2 * c.n_layers)]
    head = [torch.arange(T, dtype=torch.long) % c.vocab_size, torch.tensor([2], dtype=torch.long)]
    if shared:
        head.append(torch.tensor([past_len + T], dtype=torch.int32))
    example = (*head, *past)
    axes = {"input_ids": {0: "window"}, "logits": {0: "rows"}, STREAM_LOGITS: {0: "rows"}}
    kv_axis = "capacity" if shared else None
    axes |= {n: {2: kv_axis or "past"} for n in ins if n.startswith("past_")}
    axes |= {n: {2: kv_axis or "total"} for n in outs[2:]}
    raw = path if weights == "fp32" else path.with_suffix(".fp32.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-to-int conversions
        torch.onnx.export(graph, example, str(raw), input_names=ins, output_names=outs, dynamic_axes=axes,
                          opset_version=OPSET, dynamo=False, do_constant_folding=True,
                          custom_opsets={DOMAIN: 1} if shared else None)
    import onnx

    if weights != "fp32":
        streams = [n.name for n in onnx.load(str(raw)).graph.node if n.op_type == "MatMul" and LORA.search(n.name)]
        quantize_weights(raw, path, weights, c.vocab_size, keep=streams)
        raw.unlink()
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, {N_STREAMS: str(draft.n_streams)})  # the output's stream axis is symbolic
    onnx.save(model, str(path))
    return [path]
