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
    xsa_layers: tuple[int, ...] | None = None  # layers that use XSA; None: all (paper). Ignored for "sa"
    xsa_gate: bool = False  # subtract tanh(alpha) x the projection, alpha per head, zero-init (starts as SA)
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head (paper)
    n_sinks: int = 0  # learned attention-sink tokens prepended inside the model (paper's Figure 6: 0, 1, 4)
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
    bias: bool = False  # biases in Linear and LayerNorm layers (nanoGPT's option; paper: not stated)
    dropout: float = 0.0  # pretraining on ~1 epoch of data needs none
    rope_base: float = 10000.0  # RoPE frequency base
    init_std: float = 0.02  # N(0, init_std); residual projections get init_std / sqrt(2 n_layer)

    def __post_init__(self) -> None:
        if self.attention not in ("sa", "xsa"):
            raise ValueError(f"attention must be 'sa' or 'xsa', got {self.attention!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        # Each refusal opens with its field: config/spec.py ModelSpec.gpt_config names the config key by it.
        positive = ("n_layer", "d_model", "n_head", "head_dim", "vocab_size", "block_size", "mlp_ratio", "rope_base")
        for name in (*positive, "init_std", "xsa_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_kv_head <= 0 or self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        # Sinks are extra positions of every sequence, never predicted: beyond block_size most compute goes to them.
        if not 0 <= self.n_sinks <= self.block_size:
            raise ValueError(
                f"n_sinks={self.n_sinks} must be in [0, block_size={self.block_size}]: each sink is one more position "
                "in every block's sequence (the paper uses 0, 1 or 4)"
            )
        if self.xsa_layers is not None:
            self.xsa_layers = tuple(sorted(set(self.xsa_layers)))
            if any(not 0 <= i < self.n_layer for i in self.xsa_layers):
                raise ValueError(f"xsa_layers must be in [0, {self.n_layer}), got {list(self.xsa_layers)}")

    def uses_xsa(self, layer: int) -> bool:
        return self.attention == "xsa" and (self.xsa_layers is None or layer in self.xsa_layers)
