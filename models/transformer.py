"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over a static KV cache.

Parameter names follow Hugging Face (`embed_tokens`, `layers.i.self_attn.q_proj`, ...),
so a safetensors checkpoint loads without renaming beyond the `model.` prefix. The forward
is split into `embed`, `run_layers(first, last)` and `logits` so the exporter can cut the
model at the early-exit layer; `forward` composes the three. It knows nothing about
speculation: it maps tokens at positions cache.length.. to logits and advances the cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from mirror_rt.models.config import ModelConfig
from mirror_rt.runtime.kv_cache import KVCache
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2], with linear or llama3 scaling applied."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin) [..., head_dim] at `positions` [...]: angles in float64, then cast to `dtype`.

    The one formula every path uses (torch layers, exported graphs' tables, SS streams, exit adapters),
    so their rotations agree to the bit.
    """
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float64)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def causal_mask(start: int, T: int, device=None) -> torch.Tensor:
    """[T, start+T] bool (True: visible): query i, at position start+i, sees keys 0..start+i."""
    keys = torch.arange(start + T, device=device)
    return keys[None, :] <= (start + torch.arange(T, device=device))[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [heads, T, head_dim] by cos/sin [T, head_dim] (HF half-rotation layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [H, T, D] over keys/values [KVH, S, D] with mask [T, S] (True: visible) -> [T, H*D].

    The rep = H / KVH query heads sharing a KV head are stacked as rep*T rows against it (head h =
    kvh*rep + r, as in the target), so no per-head copy of the cache is made (and it traces to plain ops).
    """
    H, T, D = q.shape
    kvh = keys.shape[0]
    rep = H // kvh
    grouped = q.reshape(kvh, rep * T, D)
    out = F.scaled_dot_product_attention(grouped.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=mask.repeat(rep, 1))
    return out[0].reshape(H, T, D).transpose(0, 1).reshape(T, H * D)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.norm_eps)
        self.qk_norm = c.qk_norm

    def forward(self, x, rope, cache: KVCache, layer: int, mask):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.head_dim).transpose(0, 1)  # [H, T, D]
        k = self.k_proj(x).view(T, self.n_kv_heads, self.head_dim).transpose(0, 1)  # [KVH, T, D]
        v = self.v_proj(x).view(T, self.n_kv_heads, self.head_dim).transpose(0, 1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        keys, values = cache.write(layer, k, v)  # [KVH, L+T, D]
        out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                             attn_mask=mask, enable_gqa=True)
        return self.o_proj(out[0].transpose(0, 1).reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)

    def forward(self, x, rope, cache, layer, mask):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Decoder-only transformer, batch 1, driven token window by token window."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def new_cache(self, capacity: int, first: int = 0, last: int | None = None) -> KVCache:
        """An empty cache for layers first..last-1 (all layers by default)."""
        last = self.config.n_layers if last is None else last
        p = self.embed_tokens.weight
        return KVCache(last - first, self.config.n_kv_heads, self.config.head_dim, capacity,
                       dtype=p.dtype, device=p.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> hidden [T, hidden]."""
        return self.embed_tokens(tokens)

    def run_layers(self, h: torch.Tensor, cache: KVCache, first: int = 0, last: int | None = None,
                   cache_first: int | None = None):
        """Apply layers first..last-1 to h [T, hidden] at positions cache.length.. (no advance).

        The cache's layer 0 is model layer `cache_first` (default `first`: a cache made for
        exactly these layers; 0 for a full-model cache shared by a split).
        """
        last = self.config.n_layers if last is None else last
        cache_first = first if cache_first is None else cache_first
        T, start = h.shape[0], cache.length
        rope = rope_tables(self.inv_freq, torch.arange(start, start + T, device=h.device), h.dtype)
        mask = causal_mask(start, T, h.device) if T > 1 else None  # one query sees every key anyway
        for i in range(first, last):
            h = self.layers[i](h, rope, cache, i - cache_first, mask)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [T, hidden] -> logits [T, vocab]."""
        return self.lm_head(self.norm(h))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [T] at positions cache.length.. -> logits [T, vocab]; advances the cache by T."""
        h = self.run_layers(self.embed(tokens), cache)
        cache.advance(tokens.shape[0])
        return self.logits(h)


def random_model(config: ModelConfig, seed: int, dtype=torch.float32, scale: float = 0.0) -> Transformer:
    """A seeded random model (tests, smoke runs). `scale` > 0 sharpens the logits."""
    torch.manual_seed(seed)
    model = Transformer(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            if p.ndim > 1:
                p.normal_(0.0, 0.02)
            else:
                p.zero_()
        if scale:
            model.lm_head.weight.mul_(scale)
    return model.eval()
