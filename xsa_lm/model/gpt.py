"""A GPT decoder as in the XSA paper (arXiv 2603.09078). nanoGPT's model, with these changes:

- rotary position embeddings (RoPE) on q and k instead of learned absolute positions
- a LayerNorm right after the token embedding (the paper's)
- n_head * head_dim independent of d_model (the paper's 1.4B model: 24 x 128 = 1.5 d_model)
- optional grouped-query attention: n_kv_head key/value heads shared by groups of query heads
- optional learned attention sinks: n_sinks extra positions before the tokens, seen by all, never predicted
- the attention of a variant class (attention.py: SA, xsa.py: XSA per layer, optionally gated, or a lab's own)
- no biases in Linear and LayerNorm layers by default (nanoGPT's bias=False option; its default is True)
- activation checkpointing per block (a training option, not part of the architecture)
- a KV cache for generation (generate.py), which serves XSA as it serves SA
- the loss from fp32 logits (under bf16 autocast the logits are bf16), optionally a chunk of tokens at a time
  without the whole micro-batch's logits (loss_chunk, loss.py)

Kept from nanoGPT: pre-LayerNorm blocks with a GELU MLP, tied input and output embeddings, N(0, init_std) init with
the residual projections (attn.proj, mlp.proj) at init_std / sqrt(2 n_layer), and a vocabulary padded to a multiple
of 64 (by the caller, xsa_lm/config/builders.py).
"""

import math
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from xsa_lm.model.attention import KVCache, attention_layer, rope_tables
from xsa_lm.model.config import GPTConfig
from xsa_lm.model.loss import IGNORE, linear_cross_entropy


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = attention_layer(config, layer)
        self.ln_mlp = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)
        self.activation_checkpointing = False  # a training option, not part of the architecture

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            # Keep only the block's input for the backward, which runs the block again: less memory, ~1/3 more
            # compute. Inside forward, so under FSDP2 the recompute reuses the weights gathered for the backward.
            return checkpoint(self._forward, x, cos, sin, cache=cache, use_reentrant=False)
        return self._forward(x, cos, sin, cache)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x), cos, sin, cache)
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    rope_cos: torch.Tensor  # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        # Learned attention sinks: extra positions before the tokens, visible to every token, never predicted.
        self.sinks = nn.Parameter(torch.zeros(config.n_sinks, config.d_model)) if config.n_sinks else None
        self.ln_emb = nn.LayerNorm(config.d_model, bias=config.bias)  # the paper's extra LayerNorm
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        cos, sin = rope_tables(config.n_sinks + config.block_size, config.head_dim, config.rope_base)
        # Not persistent: rebuilt from the config, so checkpoints stay small and context-agnostic.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layer)  # keeps the residual stream's variance flat
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith("attn.proj") or name.endswith("mlp.proj")
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.sinks is not None:
            nn.init.normal_(self.sinks, mean=0.0, std=std)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the tied token embedding is excluded when non_embedding is True."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding else n

    def flops_per_token(self, context: int | None = None) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward): 6 x the parameters used in matmuls (the tied
        embedding counts once, as the output layer) plus the attention scores and sums, 12 x n_layer x context x
        n_head x head_dim (causality not subtracted, as torch.utils.flop_counter counts attention). Sink positions
        run through every block but are never predicted: their cost is spread over the tokens."""
        c = self.config
        T = c.block_size if context is None else context
        L = c.n_sinks + T  # positions per sequence inside the blocks
        block_params = sum(m.weight.numel() for m in self.blocks.modules() if isinstance(m, nn.Linear))
        head_params = self.lm_head.weight.numel()
        return 6 * (block_params * L / T + head_params) + 12 * c.n_layer * c.n_head * c.head_dim * L * L / T

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, caches: list[KVCache] | None = None
    ) -> torch.Tensor | tuple[torch.Tensor | None, torch.Tensor]:
        """Logits (B, T, vocab); with targets, (logits, mean cross-entropy), the logits None where the loss is chunked
        (config.loss_chunk: never formed whole). Targets of -1 are ignored. With `caches` (one KVCache per block, see
        generate.py) idx holds only the tokens after those cached."""
        logits, loss = self.logits_and_loss(self.hidden(idx, caches), targets)
        return cast(torch.Tensor, logits) if targets is None else (logits, cast(torch.Tensor, loss))

    def hidden(self, idx: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        """The last block's output at the tokens' positions (B, T, d_model): sink positions are never predicted."""
        past = len(caches[0]) if caches else 0
        S = self.config.n_sinks if past == 0 else 0  # the sinks enter with the first tokens only
        T = idx.size(1)
        if past + S + T > self.config.n_sinks + self.config.block_size:
            raise ValueError(f"sequence length {past + T} exceeds block_size {self.config.block_size}")
        cos, sin = self.rope_cos[past : past + S + T], self.rope_sin[past : past + S + T]
        x = self.wte(idx)
        if S and self.sinks is not None:
            x = torch.cat([self.sinks.to(x.dtype).expand(x.size(0), -1, -1), x], dim=1)
        x = self.drop(self.ln_emb(x))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, caches[i] if caches else None)
        return x[:, S:]

    def logits_and_loss(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The head (final LayerNorm, tied output layer) and, with targets, the mean cross-entropy. A method of its
        own so that training under FSDP2 can compile it apart from the blocks (xsa_lm/train/module.py)."""
        x = self.ln_f(x)
        if targets is not None and self.config.loss_chunk:
            return None, linear_cross_entropy(x, self.lm_head.weight, targets, self.config.loss_chunk)[0]
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=IGNORE)
        return logits, loss

    @torch.no_grad()
    def token_losses(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each target's cross-entropy (B, T), 0 where it is -1: validation's and `xsa-lm analyze`'s numbers. Never
        the whole batch's fp32 logits: a chunk (loss_chunk), else one window, at a time."""
        x = self.ln_f(self.hidden(idx))
        if self.config.loss_chunk:
            return linear_cross_entropy(x, self.lm_head.weight, targets, self.config.loss_chunk)[1]
        rows = zip(self.lm_head(x), targets, strict=True)
        return torch.stack([F.cross_entropy(r.float(), t, ignore_index=IGNORE, reduction="none") for r, t in rows])
