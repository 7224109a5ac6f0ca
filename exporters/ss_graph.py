"""ONNX export of a Speculative Streaming draft (`models.ss_draft.StreamDraft`).

`StreamDraftGraph` is `StreamDraft.forward_streams` as a traceable function with explicit KV
(main keys only, as in the torch cache): inputs `input_ids` [T], `last_rows` [1] and the past
KV per layer; outputs `logits` [R, vocab] and `stream_logits` [R, n_s, vocab] for the window's
last R = last_rows positions, then the present KV. Stream rows are computed for those R
positions only: a stream row never influences a main row, so the main logits and the KV are
those of the plain draft graph, and a prompt (last_rows 1) pays for one position's streams.
The draft worker feeds [unfed tokens, guesses] with last_rows = len(guesses) + 1.
Limitations: explicit KV only (the stream mask is not expressible with GroupQueryAttention),
so the SS graph cannot adopt the target's shared buffers without a copy (ORTModel.adopt copies).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from mirror_rt.exporters.split import (
    LAST_ROWS,
    PAST_NAMES,
    PRESENT_NAMES,
    SplitGraph,
    graph_spec,
    kv_names,
)
from mirror_rt.models.transformer import apply_rope
from torch import nn

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
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = torch.cat([q[:T], q[T:] + extra.q(x[T:])])
        v = torch.cat([v[:T], v[T:] + extra.v(x[T:])])
        q = q.reshape(-1, self.n_heads, self.head_dim).transpose(0, 1)
        k = k.reshape(-1, self.n_kv_heads, self.head_dim).transpose(0, 1)
        v = v.reshape(-1, self.n_kv_heads, self.head_dim).transpose(0, 1)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
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


def ss_input_names(n_layers: int) -> list[str]:
    return ["input_ids", LAST_ROWS] + kv_names(n_layers, PAST_NAMES)


def ss_output_names(n_layers: int) -> list[str]:
    return ["logits", STREAM_LOGITS] + kv_names(n_layers, PRESENT_NAMES)


def export_stream_draft(draft, table_len: int, weights: str, path: Path) -> list[Path]:
    """Write `path` (.onnx): the SS draft graph, weights fp32 or weight-only int8/int4/q4_1 (the
    base's products; the small stream LoRA products stay fp32)."""
    from mirror_rt.exporters.onnx import OPSET, WEIGHTS, quantize_weights

    if weights not in WEIGHTS:
        raise ValueError(f"--format onnx supports weights {', '.join(WEIGHTS)}, not '{weights}'")
    c = draft.config
    graph = StreamDraftGraph(draft, table_len).eval()
    ins, outs = ss_input_names(c.n_layers), ss_output_names(c.n_layers)
    dtype = draft.base.embed_tokens.weight.dtype
    past = [torch.zeros(1, c.n_kv_heads, 2, c.head_dim, dtype=dtype) for _ in range(2 * c.n_layers)]
    example = (torch.arange(3, dtype=torch.long) % c.vocab_size, torch.tensor([2], dtype=torch.long), *past)
    axes = {"input_ids": {0: "window"}, "logits": {0: "rows"}, STREAM_LOGITS: {0: "rows"}}
    axes |= {n: {2: "past"} for n in ins[2:]} | {n: {2: "total"} for n in outs[2:]}
    raw = path if weights == "fp32" else path.with_suffix(".fp32.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-to-int conversions
        torch.onnx.export(graph, example, str(raw), input_names=ins, output_names=outs, dynamic_axes=axes,
                          opset_version=OPSET, dynamo=False, do_constant_folding=True)
    import onnx

    if weights != "fp32":
        streams = [n.name for n in onnx.load(str(raw)).graph.node if n.op_type == "MatMul" and LORA.search(n.name)]
        quantize_weights(raw, path, weights, c.vocab_size, keep=streams)
        raw.unlink()
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, {N_STREAMS: str(draft.n_streams)})  # the output's stream axis is symbolic
    onnx.save(model, str(path))
    return [path]
