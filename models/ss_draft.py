"""Speculative Streaming (SS) draft: lookahead streams in the draft's top layers.

Stream j at position t predicts token t + 2 + j. Stream rows attend to the prefix and their own position's
lower streams; main rows never see stream rows and stream keys never enter the cache, so the main stream is exactly
the base draft, and the streams' own LoRA deltas never change it.
Design notes: docs/design/models.md
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mirror_rt.models.transformer import Transformer, apply_rope, rope_tables

MAX_STREAMS = 16  # lookahead streams per draft: each adds a row per position to every stream forward


class LoRA(nn.Module):
    """x -> B(A(x)) with B initialised to zero (starts as the identity delta)."""

    def __init__(self, d_in: int, d_out: int, rank: int):
        super().__init__()
        self.a = nn.Linear(d_in, rank, bias=False)
        self.b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.a.weight, std=1.0 / rank)
        nn.init.zeros_(self.b.weight)

    def forward(self, x):
        return self.b(self.a(x))


class StreamLayer(nn.Module):
    """The stream-only parameters of one top layer."""

    def __init__(self, base_layer, rank: int):
        super().__init__()
        attn, mlp = base_layer.self_attn, base_layer.mlp
        self.q = LoRA(attn.q_proj.in_features, attn.q_proj.out_features, rank)
        self.v = LoRA(attn.v_proj.in_features, attn.v_proj.out_features, rank)
        self.down = LoRA(mlp.down_proj.in_features, mlp.down_proj.out_features, rank)


class StreamDraft(nn.Module):
    """A base draft Transformer plus n_s lookahead streams in its top layers."""

    def __init__(self, base: Transformer, n_streams: int = 2, n_stream_layers: int = 2, rank: int = 16):
        super().__init__()
        n = base.config.n_layers
        if not 1 <= n_stream_layers <= n:
            raise ValueError(f"--stream-layers must be in 1..{n}, got {n_stream_layers}")
        if not 1 <= n_streams <= MAX_STREAMS:
            raise ValueError(f"--streams must be in 1..{MAX_STREAMS}, got {n_streams}")
        if not 1 <= rank <= base.config.hidden_size:
            raise ValueError(f"--rank must be in 1..{base.config.hidden_size} (the hidden size), got {rank}")
        self.base, self.n_streams, self.first = base, n_streams, n - n_stream_layers
        self.stream_embed = nn.Parameter(torch.zeros(n_streams, base.config.hidden_size))
        nn.init.normal_(self.stream_embed, std=0.02)
        self.stream_layers = nn.ModuleList(StreamLayer(base.layers[i], rank) for i in range(self.first, n))
        dtype = base.embed_tokens.weight.dtype
        self.stream_embed.data = self.stream_embed.data.to(dtype)
        self.stream_layers.to(dtype)

    @property
    def config(self):
        return self.base.config

    def forward_streams(self, tokens: torch.Tensor, cache):
        """tokens [T] at cache.length.. -> main logits [T, vocab], stream logits [T, n_s, vocab]; advances by T."""
        h = self.base.run_layers(self.base.embed(tokens), cache, 0, self.first, cache_first=0)
        s = h[:, None, :] + self.stream_embed[None].to(h.dtype)  # [T, n_s, hidden]
        start = cache.length
        for i in range(self.first, self.config.n_layers):
            h, s = self._block(i, h, s, cache, start)
        cache.advance(tokens.shape[0])
        return self.base.logits(h), self.base.logits(s)

    def _block(self, i: int, h, s, cache, start: int):
        layer, extra = self.base.layers[i], self.stream_layers[i - self.first]
        attn_h, attn_s = self._attention(layer, extra, layer.input_layernorm(h), layer.input_layernorm(s),
                                         cache, i, start)
        h, s = h + attn_h, s + attn_s
        xh, xs = layer.post_attention_layernorm(h), layer.post_attention_layernorm(s)
        mlp = layer.mlp
        inner = F.silu(mlp.gate_proj(xs)) * mlp.up_proj(xs)
        return h + mlp(xh), s + mlp.down_proj(inner) + extra.down(inner)

    def _attention(self, layer, extra, xh, xs, cache, i: int, start: int):
        attn, c = layer.self_attn, self.config
        T, S = xh.shape[0], self.n_streams
        rows = torch.cat([xh, xs.reshape(T * S, -1)])  # [T + T*S, hidden]: main rows, then streams
        q, k, v = stream_qkv(attn, extra, rows, T, c)
        cos, sin = self._rope(start, T, S, xh)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.write(i, k[:, :T], v[:, :T])  # main keys only: [KVH, L+T, D]
        keys = torch.cat([keys, k[:, T:]], dim=1)
        values = torch.cat([values, v[:, T:]], dim=1)
        mask = stream_mask(start, T, S, xh.device)
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, enable_gqa=True)[0]
        out = attn.o_proj(out.transpose(0, 1).reshape(T + T * S, -1))
        return out[:T], out[T:].view(T, S, -1)

    def _rope(self, start: int, T: int, S: int, like):
        """Positions: main row p at start+p; stream j of row p at start+p+1+j (the slot it predicts from)."""
        main = torch.arange(start, start + T, device=like.device)
        streams = (main[:, None] + 1 + torch.arange(S, device=like.device)[None]).reshape(-1)
        return rope_tables(self.base.inv_freq, torch.cat([main, streams]), like.dtype)


def stream_qkv(attn, extra, rows: torch.Tensor, n_main: int, config):
    """Queries, keys, values [heads, rows, head_dim] of `rows` [n_main main rows, then stream rows].

    Main and stream rows share every base product; stream rows add their LoRA deltas on q and v.
    Shared by `StreamDraft` and its ONNX graphs (exporters.ss_graph), so both compute the same thing.
    """
    q, k, v = attn.q_proj(rows), attn.k_proj(rows), attn.v_proj(rows)
    q = torch.cat([q[:n_main], q[n_main:] + extra.q(rows[n_main:])])
    v = torch.cat([v[:n_main], v[n_main:] + extra.v(rows[n_main:])])
    q = q.reshape(-1, config.n_heads, config.head_dim).transpose(0, 1)
    k = k.reshape(-1, config.n_kv_heads, config.head_dim).transpose(0, 1)
    v = v.reshape(-1, config.n_kv_heads, config.head_dim).transpose(0, 1)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def stream_mask(start: int, T: int, S: int, device=None) -> torch.Tensor:
    """Boolean attention mask [T + T*S, start + T + T*S] (True = may attend).

    Rows: T main rows, then stream j of main row p at T + p*S + j. Columns: start + T main
    keys (the cache), then the T*S stream keys in the same order.
    Example (start 0, T 2, S 1): main 0 sees key 0; main 1 sees keys 0-1; stream(0) sees
    main key 0 and itself; stream(1) sees main keys 0-1 and itself.
    """
    L = start + T
    rows = T + T * S
    mask = torch.zeros(rows, L + T * S, dtype=torch.bool, device=device)
    p = torch.arange(T, device=device)
    keys = torch.arange(L, device=device)
    mask[:T, :L] = keys[None, :] <= (start + p)[:, None]  # main rows: causal over the prefix
    stream_p = p.repeat_interleave(S)  # [T*S] main position of each stream row
    stream_j = torch.arange(S, device=device).repeat(T)
    mask[T:, :L] = keys[None, :] <= (start + stream_p)[:, None]  # prefix up to its own position
    same = (stream_p[:, None] == stream_p[None, :]) & (stream_j[None, :] <= stream_j[:, None])
    mask[T:, L:] = same  # its own position's streams with index <= j
    return mask


def stream_config(draft: StreamDraft) -> dict:
    return {"n_streams": draft.n_streams, "n_stream_layers": draft.config.n_layers - draft.first,
            "rank": draft.stream_layers[0].q.a.out_features, "base_vocab_size": draft.config.vocab_size,
            "base_layers": draft.config.n_layers, "hidden_size": draft.config.hidden_size}


def load_streams(base, folder: Path) -> StreamDraft:
    """A StreamDraft over `base` with the trained stream weights of `folder` (checked against base)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        cfg = json.loads((folder / "streams.json").read_text())
        shape = (cfg["base_vocab_size"], cfg["base_layers"], cfg["hidden_size"])
        sizes = (int(cfg["n_streams"]), int(cfg["n_stream_layers"]), int(cfg["rank"]))
        state = load_file(str(folder / "streams.safetensors"))
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise ValueError(f"{folder}: not mirror-rt SS streams (streams.json + streams.safetensors; "
                         f"{type(exc).__name__})") from None
    c = base.config
    if shape != (c.vocab_size, c.n_layers, c.hidden_size):
        raise ValueError(f"{folder}: streams were trained for another draft shape")
    if not all(bool(torch.isfinite(t).all()) for t in state.values()):
        raise ValueError(f"{folder}: stream weights are not finite (NaN or inf: the training diverged)")
    draft = StreamDraft(base, *sizes)
    layers = {k.removeprefix("stream_layers."): v for k, v in state.items() if k.startswith("stream_layers.")}
    if set(state) != {"stream_embed", *(f"stream_layers.{k}" for k in layers)}:
        raise ValueError(f"{folder}: stream weights do not match their config")
    try:  # the stream parts alone: the base may be an int8 copy, whose modules load no float weights
        draft.stream_layers.load_state_dict(layers, strict=True)
        with torch.no_grad():
            draft.stream_embed.copy_(state["stream_embed"])
    except RuntimeError:
        raise ValueError(f"{folder}: stream weights do not match their config") from None
    return draft
