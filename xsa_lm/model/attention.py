"""Causal self attention with RoPE; XSA layers add the step in xsa.py after it."""

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from xsa_lm.model.config import GPTConfig
from xsa_lm.model.xsa import ExclusiveOutputProjection, exclusive_projection


def rope_tables(block_size: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (block_size, head_dim) for rotate-half RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (B, H, T, D) by position; cos/sin are (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache:
    """One layer's keys and values of the tokens seen so far, for generation: each step adds the new tokens'."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.size(2)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        assert config.n_kv_head is not None  # GPTConfig resolves None to n_head
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.qkv = nn.Linear(config.d_model, (config.n_head + 2 * config.n_kv_head) * config.head_dim, bias=config.bias)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=config.bias)  # W_o
        self.exclusive = config.uses_xsa(layer)
        # Gated XSA: z = y - tanh(alpha_h) x projection, alpha zero-initialised so training starts as SA.
        self.gate = nn.Parameter(torch.zeros(config.n_head)) if self.exclusive and config.xsa_gate else None
        self.xsa_eps = config.xsa_eps
        self.dropout = config.dropout
        # Diagnostics set an observer: it sees q, k, v, y (before XSA) and z of this layer, then they are dropped.
        self.observer: Callable[..., None] | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).view(B, T, H + 2 * H_kv, D).transpose(1, 2).split([H, H_kv, H_kv], dim=1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values, past = k, v, 0
        if cache is not None:  # generation: attend to every earlier token too
            past = len(cache)
            keys, values = cache.update(k, v)
        # Causal: query t (at position past + t) sees keys 0 .. past + t.
        mask = None if past == 0 else torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, enable_gqa=H_kv != H
        )
        # (B, T, H, D) order from here: SDPA's kernels return y laid out that way in memory, so the output projection
        # reads it (and XSA's result, computed in that order) without a copy.
        y_t = y.transpose(1, 2)
        if not self.exclusive:
            out = self.proj(y_t.reshape(B, T, H * D))
        else:
            # Each query head projects on its KV group's v: y as (B, T, H_kv, G, D) against v as (B, T, H_kv, 1, D).
            # Only the new tokens' own v is needed, so a KV cache serves XSA as it serves SA.
            y_t, v_t = y_t.unflatten(2, (H_kv, H // H_kv)), v.transpose(1, 2).unsqueeze(3)
            scale = None if self.gate is None else torch.tanh(self.gate).view(H_kv, H // H_kv, 1)
            # out = self.proj(xsa_reference(y_t, v_t, self.xsa_eps, scale).flatten(-3)), fused to keep no z
            weight, bias = self.proj.weight, self.proj.bias
            out = ExclusiveOutputProjection.apply(y_t, v_t, self.xsa_eps, scale, weight, bias)
        if self.observer is not None:  # diagnostics: z once more, to look at
            z = exclusive_projection(y_t, v_t, eps=self.xsa_eps, scale=scale) if self.exclusive else None
            self.observer(q=q, k=k, v=v, y=y, z=None if z is None else z.reshape(B, T, H, D).transpose(1, 2))
        return out
