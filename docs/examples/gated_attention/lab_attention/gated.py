"""The sigmoid output gate of "Gated Attention for Large Language Models" (Qiu et al. 2025, arXiv 2505.06708), the
placement they found best (G1): each head's attention output times sigmoid(x W_g), x the block's input after its
LayerNorm, W_g head-specific; elementwise (one gate per dimension) or headwise (one per head)."""

import torch
import torch.nn as nn

from xsa_lm.model import CausalSelfAttention, GPTConfig


class GatedAttention(CausalSelfAttention):
    """Softmax attention whose head outputs are y * sigmoid(x W_g); W_g is initialised with the model's other
    Linear layers (N(0, init_std), no bias unless model.bias), so the gates start near 1/2."""

    def __init__(self, config: GPTConfig, layer: int = 0, granularity: str = "elementwise") -> None:
        super().__init__(config, layer)
        if granularity not in ("elementwise", "headwise"):
            raise ValueError(f"granularity={granularity} must be one of elementwise, headwise")
        per_head = config.head_dim if granularity == "elementwise" else 1
        self.gate = nn.Linear(config.d_model, config.n_head * per_head, bias=config.bias)
        self.per_head = per_head

    def heads(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        # y: (B, T, H, D); the gate (B, T, H, D) or (B, T, H, 1), broadcast over D
        return y * torch.sigmoid(self.gate(x)).unflatten(-1, (self.n_head, self.per_head))
