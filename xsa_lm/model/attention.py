"""Causal self attention with RoPE, the class every attention variant subclasses (XSA: xsa.py)."""

import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from xsa_lm.model.config import GPTConfig


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
    """Softmax attention (SA), and what every attention variant is: a subclass, built once per layer as
    `cls(config, layer, **options)` (the options: the other keys of its configs/attention/<name>.yaml), that
    overrides `heads` (and, to fuse it with W_o, `project`). The layouts: x (B, T, d_model) is the block's input after
    its LayerNorm; q (B, H, T, D) and k (B, H_kv, T, D) after RoPE, v (B, H_kv, T, D), for the new tokens only (a
    KV cache holds the earlier ones); y (B, T, H, D) is SDPA's output. A constructor refuses an option's value with a
    ValueError opening with `<option>=<value>`. docs/variants.md has a worked example."""

    # The memory plan (train/memory.py) counts XSA's saved numbers and backward temporaries for a variant that says so.
    exclusive_memory: ClassVar[bool] = False

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        assert config.n_kv_head is not None  # GPTConfig resolves None to n_head
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.qkv = nn.Linear(config.d_model, (config.n_head + 2 * config.n_kv_head) * config.head_dim, bias=config.bias)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=config.bias)  # W_o
        self.dropout = config.dropout
        # Diagnostics set an observer: it sees q, k, v, y and the head outputs z of this layer (None where z is y).
        self.observer: Callable[..., None] | None = None

    @classmethod
    def option_names(cls) -> list[str]:
        """The options this variant takes: its constructor's arguments after config and layer."""
        params = list(inspect.signature(cls).parameters.values())[2:]
        return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    @classmethod
    def settled_options(cls, config: GPTConfig, options: dict[str, Any]) -> dict[str, Any]:
        """The options (every one given, defaults filled in) in the one form the model config keeps, so that configs
        of the same model compare equal (a resume checks it). As given, unless a variant says otherwise."""
        return options

    def heads(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """The head outputs (B, T, H, D) that W_o projects: SA's are y itself."""
        return y

    def project(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output (B, T, d_model): W_o of the head outputs. A variant may fuse the two (XSA keeps no z)."""
        return self.proj(self.heads(x, q, k, v, y).flatten(2))

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
        out = self.project(x, q, k, v, y_t)
        if self.observer is not None:  # diagnostics: the head outputs once more, to look at
            z = self.heads(x, q, k, v, y_t)
            self.observer(q=q, k=k, v=v, y=y, z=None if z is y_t else z.transpose(1, 2))
        return out


def attention_layer(config: GPTConfig, layer: int) -> CausalSelfAttention:
    """Layer `layer`'s attention: config's variant, built with its options."""
    return config.attention_class(config, layer, **config.attention_options)
