"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over a static KV cache.

Hugging Face parameter names; `embed`, `run_layers(first, last)` and `logits` let the exporter cut it at the
early exit. It knows nothing of speculation: tokens at cache.length.. -> logits, and the cache advances.
Design notes: docs/design/models.md
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mirror_rt.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):  # normalize in fp32 (fp16 overflows x^2 on SmolLM's activations)
            return self.weight * self._normalize(x.float()).to(x.dtype)
        return self.weight * self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


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


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """q [H, T, D] over keys/values [KVH, S, D] with mask [T, S] (True: visible; None: all) -> [T, H*D].

    The rep = H / KVH query heads sharing a KV head are stacked as rep*T rows against it (head h =
    kvh*rep + r, as in the target), so no per-head copy of the cache is made, it traces to plain ops, and
    SDPA sees plain multi-head attention (no `enable_gqa`, which keeps CUDA's fused kernels out).
    """
    H, T, D = q.shape
    kvh = keys.shape[0]
    rep = H // kvh
    grouped = q.reshape(kvh, rep * T, D)
    out = F.scaled_dot_product_attention(grouped.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=None if mask is None else mask.repeat(rep, 1))
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

    def forward(self, x, rope, cache, layer: int, mask):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.head_dim).transpose(0, 1)  # [H, T, D]
        k = self.k_proj(x).view(T, self.n_kv_heads, self.head_dim).transpose(0, 1)  # [KVH, T, D]
        v = self.v_proj(x).view(T, self.n_kv_heads, self.head_dim).transpose(0, 1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        keys, values = cache.write(layer, k, v)  # [KVH, L+T, D], or every slot [KVH, S, D] (static shapes)
        return self.o_proj(grouped_attention(q, keys, values, mask))


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


ROPE_TABLE = 4096  # positions in the first RoPE table (it grows on demand up to the context)
MAX_PAD = 64  # rows a static-shape window may be padded by: table rows exist past the context for them


class Transformer(nn.Module):
    """Decoder-only transformer, batch 1, driven token window by token window.

    RoPE tables (`rope_cos`, `rope_sin` [positions, head_dim]) are precomputed at the weights' dtype from
    the inverse frequencies kept in fp32 (fp64 for fp64 weights): a cast or a move of the model derives
    them again instead of rounding them (a bf16 `inv_freq` would shift every angle). With bf16 / fp16
    weights the LM head also runs from an fp32 copy of its (bf16) weights, so logits carry 24 mantissa
    bits, not 8: bf16 logits tie often (the target's top two share one bf16 value), and a tie breaks
    differently in windows of different lengths, so speculative output would leave `ar`'s at ties.
    The copy costs the head's size again in memory (SmolLM2-135M: 113 MB; 1.7B: 400 MB).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for name in ("inv_freq", "rope_cos", "rope_sin", "head32"):
            self.register_buffer(name, None, persistent=False)
        self._derive_rope(min(config.max_seq_len, ROPE_TABLE) + MAX_PAD)
        self._head_key = None  # (pointer, version) of the LM head weight head32 was copied from

    def _apply(self, fn, recurse=True):
        """`.to()`, `.cuda()`, `.half()`...: the RoPE tables follow the weights, derived again, never cast."""
        super()._apply(fn, recurse)
        self._derive_rope(self.rope_cos.shape[0])
        return self

    def _derive_rope(self, positions: int) -> None:
        p = self.embed_tokens.weight
        self.inv_freq = rope_inv_freq(self.config).to(p.device, torch.promote_types(p.dtype, torch.float32))
        self.rope_cos, self.rope_sin = rope_tables(self.inv_freq, torch.arange(positions, device=p.device), p.dtype)

    def ensure_rope(self, positions: int) -> None:
        """Grow the RoPE tables to cover positions 0..positions-1 (doubling; at most the context + MAX_PAD)."""
        have = self.rope_cos.shape[0]
        if positions > have:
            limit = self.config.max_seq_len + MAX_PAD
            self._derive_rope(min(max(positions, 2 * have), max(limit, positions)))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> hidden [T, hidden]."""
        return self.embed_tokens(tokens)

    def run_layers(self, h: torch.Tensor, cache, first: int = 0, last: int | None = None,
                   cache_first: int | None = None):
        """Apply layers first..last-1 to h [T, hidden] at positions cache.length.. (no advance).

        The cache's layer 0 is model layer `cache_first` (default `first`: a cache made for
        exactly these layers; 0 for a full-model cache shared by a split).
        """
        last = self.config.n_layers if last is None else last
        cache_first = first if cache_first is None else cache_first
        T, start = h.shape[0], cache.length
        self.ensure_rope(start + T)
        rope = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        mask = causal_mask(start, T, h.device) if T > 1 else None  # one query sees every key anyway
        for i in range(first, last):
            h = self.layers[i](h, rope, cache, i - cache_first, mask)
        return h

    def run_layers_at(self, h: torch.Tensor, positions: torch.Tensor, cache, first: int = 0,
                      last: int | None = None, cache_first: int | None = None) -> torch.Tensor:
        """The static-shape twin of `run_layers`: h [T, hidden] at device-side `positions` [T].

        Each layer writes its keys/values at those slots and attends over all of the cache's slots under a
        causal mask built from the positions on the device, so every shape depends only on T and the slot
        count: the function compiles (`torch.compile`, CUDA graphs) once per window size. Rows after a
        window's real ones (padding) write slots past it, which nothing commits and the next window overwrites.
        """
        last = self.config.n_layers if last is None else last
        cache_first = first if cache_first is None else cache_first
        rope = self.rope_cos[positions], self.rope_sin[positions]
        slots = torch.arange(cache.keys.shape[2], device=h.device)
        mask = slots[None, :] <= positions[:, None]  # [T, slots]: query at position p sees slots 0..p
        at = SlotWriter(cache, positions)
        for i in range(first, last):
            h = self.layers[i](h, rope, at, i - cache_first, mask)
        return h

    def window_at(self, x: torch.Tensor, positions: torch.Tensor, cache, first: int = 0,
                  last: int | None = None, cache_first: int = 0, head_rows: int | None = None) -> torch.Tensor:
        """One static-shape window (what `--compile` compiles): ids [T] (first == 0) or hidden [T, hidden]
        through layers first..last-1 at `positions` (`run_layers_at`); past the last layer, the final norm
        and LM head too -> logits [T, vocab] (or of the last `head_rows` rows), else hidden [T, hidden]."""
        last = self.config.n_layers if last is None else last
        h = self.run_layers_at(self.embed(x) if first == 0 else x, positions, cache, first, last, cache_first)
        if last < self.config.n_layers:
            return h
        return self.logits(h if head_rows is None else h[-head_rows:])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [T, hidden] -> logits [T, vocab] (fp32 for bf16 / fp16 weights)."""
        if not self._low_precision_head():
            return self.lm_head(self.norm(h))
        if not torch.compiler.is_compiling():  # compiled callers refresh it before the call (refresh_head)
            self.refresh_head()
        return F.linear(self.norm(h).float(), self.head32)

    def _low_precision_head(self) -> bool:
        weight = self.lm_head.weight  # a method, not a tensor, in torch's dynamically quantized Linear
        return isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16)

    def refresh_head(self) -> None:
        """Copy a bf16 / fp16 LM head to fp32 when its weights changed (loaded, initialized, moved) since the
        last copy."""
        if not self._low_precision_head():
            return
        weight = self.lm_head.weight
        key = (weight.data_ptr(), weight._version)
        if key != self._head_key:
            with torch.no_grad():
                self.head32 = weight.detach().float()
            self._head_key = key

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache, last_rows: int | None = None) -> torch.Tensor:
        """tokens [T] at positions cache.length.. -> logits [T, vocab] (or its last `last_rows`); advances by T."""
        h = self.run_layers(self.embed(tokens), cache)
        cache.advance(tokens.shape[0])
        return self.logits(h if last_rows is None else h[-last_rows:])


class SlotWriter:
    """A cache seen through device-side write positions: `write` stores at `positions`, returns every slot."""

    def __init__(self, cache, positions: torch.Tensor):
        self.cache, self.positions = cache, positions

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self.cache.write_at(layer, self.positions, k, v)


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
