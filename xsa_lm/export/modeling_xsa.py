"""A GPT of xsa-lm with SA or XSA attention (arXiv 2603.09078), as a transformers model: xsa_lm/model's computation
under the same parameter names, so a checkpoint's weights load as they are. XSA: each head's output loses its component
along the token's own value, z_i = y_i - s (y_i . v_i) / (||v_i||^2 + eps) v_i, s = 1 or, gated, tanh(alpha) per head.
Shipped beside every exported model; needs only torch and transformers."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # rotate-half RoPE, as xsa-lm's

from .configuration_xsa import XSAConfig


class XSAAttention(nn.Module):
    def __init__(self, config: XSAConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer  # its place in the KV cache
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head or config.n_head, config.head_dim
        self.qkv = nn.Linear(config.d_model, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=config.bias)
        self.proj = nn.Linear(self.n_head * self.head_dim, config.d_model, bias=config.bias)  # W_o
        self.exclusive = config.attention == "xsa" and (config.xsa_layers is None or layer in config.xsa_layers)
        self.gate = nn.Parameter(torch.zeros(config.n_head)) if self.exclusive and config.xsa_gate else None
        self.xsa_eps, self.dropout = config.xsa_eps, config.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask, cache: Cache | None) -> torch.Tensor:
        B, T, _ = x.shape
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).view(B, T, H + 2 * H_kv, D).transpose(1, 2).split([H, H_kv, H_kv], dim=1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = (k, v) if cache is None else cache.update(k, v, self.layer)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, enable_gqa=H_kv != H
        )
        y = y.transpose(1, 2)  # (B, T, H, D)
        if self.exclusive:
            # Each query head projects on its KV group's value of the same token: y as (B, T, H_kv, G, D) against
            # v as (B, T, H_kv, 1, D). Only the new tokens' own v is needed, so the KV cache serves XSA as it does SA.
            y, v = y.unflatten(2, (H_kv, H // H_kv)), v.transpose(1, 2).unsqueeze(3)
            scale = 1.0 if self.gate is None else torch.tanh(self.gate).view(H_kv, H // H_kv, 1)
            # z = y - scale (y . v) / (||v||^2 + eps) v, in at least fp32: bf16 loses the orthogonality
            y32, v32 = (t.to(torch.promote_types(y.dtype, torch.float32)) for t in (y, v))
            coef = scale * (y32 * v32).sum(-1, keepdim=True) / ((v32 * v32).sum(-1, keepdim=True) + self.xsa_eps)
            y = (y32 - coef * v32).to(y.dtype)
        return self.proj(y.reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, config: XSAConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):  # pre-LayerNorm
    def __init__(self, config: XSAConfig, layer: int) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = XSAAttention(config, layer)
        self.ln_mlp = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x), cos, sin, mask, cache)
        return x + self.mlp(self.ln_mlp(x))


class XSAForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = XSAConfig
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    _tied_weights_keys = {"lm_head.weight": "wte.weight"}
    _input_embed_layer = "wte"

    def _init_weights(self, module: nn.Module) -> None:
        """For weights a checkpoint does not hold: transformers' own, the XSA gate at 0 (SA), sinks N(0, init_std)."""
        super()._init_weights(module)
        if isinstance(module, XSAAttention) and module.gate is not None:
            init.zeros_(module.gate)
        if isinstance(module, XSAForCausalLM) and module.sinks is not None:
            init.normal_(module.sinks, mean=0.0, std=self.config.init_std)

    def __init__(self, config: XSAConfig) -> None:
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        # Learned attention sinks: positions before the tokens, visible to every token, never predicted.
        self.sinks = nn.Parameter(torch.zeros(config.n_sinks, config.d_model)) if config.n_sinks else None
        self.ln_emb = nn.LayerNorm(config.d_model, bias=config.bias)  # the paper's LayerNorm after the embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits (B, T, vocab) of input_ids (B, T), the tokens after those cached; with labels (shifted inside, -100
        ignored) the mean cross-entropy. attention_mask (B, all tokens so far): 0 at padding, for padded batches."""
        if cache is None and (self.config.use_cache if use_cache is None else use_cache):
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0  # sinks included
        S = self.config.n_sinks if past == 0 else 0  # the sinks enter with the first tokens only
        B, T = input_ids.shape
        seen = max(past - self.config.n_sinks, 0)  # tokens before these
        if seen + T > self.config.block_size:
            raise ValueError(f"sequence length {seen + T} exceeds block_size {self.config.block_size}")
        if position_ids is None:
            position_ids = torch.arange(seen, seen + T, device=input_ids.device).expand(B, T)
        # Rotate-half RoPE: the sinks at 0 .. n_sinks - 1 (with the first tokens only), the tokens after them
        sinks = torch.arange(S, device=input_ids.device).expand(B, S)
        positions = torch.cat([sinks, position_ids + self.config.n_sinks], dim=1)
        D = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_base ** (torch.arange(0, D, 2, device=input_ids.device).float() / D))
        angles = (positions.float().unsqueeze(-1) * inv_freq).repeat(1, 1, 2)
        mask = self.attention_mask(attention_mask, past=past, new=S + T)

        x = self.wte(input_ids)
        if S and self.sinks is not None:
            x = torch.cat([self.sinks.to(x.dtype).expand(B, -1, -1), x], dim=1)
        x = self.drop(self.ln_emb(x))
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # as xsa-lm's tables, cast with the model
        for block in self.blocks:
            x = block(x, cos, sin, mask, cache)
        x = x[:, S:][:, -logits_to_keep:]  # sink positions are never predicted; logits_to_keep=0: every position
        logits = self.lm_head(self.ln_f(x))
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)  # shifts labels
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def attention_mask(self, padding: torch.Tensor | None, past: int, new: int) -> torch.Tensor | None:
        """Causal over the cached and new positions (None: SDPA's own), without `padding`'s 0s (B, tokens) but with
        the sinks; a padding position sees itself, so that no row is empty (its output is never used)."""
        causal = torch.ones(new, past + new, dtype=torch.bool, device=self.device).tril(past)
        if padding is None or bool(padding.all()):
            return causal if past else None
        keys = torch.cat([padding.new_ones(padding.size(0), self.config.n_sinks), padding], dim=1).bool()
        itself = causal & ~causal.tril(past - 1)  # the diagonal of the new positions
        return (causal & keys[:, None, None, :]) | itself
