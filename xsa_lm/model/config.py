"""GPTConfig: every architectural choice of the decoder, with the paper's defaults."""

from dataclasses import dataclass


@dataclass
class GPTConfig:
    n_layer: int = 4  # transformer blocks
    d_model: int = 128  # residual stream width
    n_head: int = 4  # attention heads
    head_dim: int = 32  # per-head width; n_head * head_dim may differ from d_model (paper)
    vocab_size: int = 4096  # tokenizer vocabulary, padded to a multiple of 64 by the caller
    block_size: int = 128  # longest context the model supports (RoPE tables are built for it)
    attention: str = "sa"  # "sa": softmax attention; "xsa": exclusive self attention
    xsa_eps: float = 1e-6  # guards ||v||^2 when normalising v in XSA (fp32)
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
    bias: bool = False  # biases in Linear and LayerNorm layers (paper: none)
    dropout: float = 0.0  # pretraining on ~1 epoch of data needs none
    rope_base: float = 10000.0  # RoPE frequency base
    init_std: float = 0.02  # N(0, init_std); residual projections get init_std / sqrt(2 n_layer)

    def __post_init__(self) -> None:
        if self.attention not in ("sa", "xsa"):
            raise ValueError(f"attention must be 'sa' or 'xsa', got {self.attention!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("n_layer", "d_model", "n_head", "head_dim", "vocab_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
