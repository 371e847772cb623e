"""XSAConfig: xsa-lm's GPTConfig as a transformers configuration, shipped beside every exported model."""

from transformers import PretrainedConfig


class XSAConfig(PretrainedConfig):
    model_type = "xsa_gpt"
    attribute_map = {  # transformers' standard names for GPTConfig's fields
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "num_key_value_heads": "n_kv_head",
        "max_position_embeddings": "block_size",
        "initializer_range": "init_std",
    }

    n_layer: int = 4  # transformer blocks
    d_model: int = 128  # residual stream width
    n_head: int = 4  # attention heads
    head_dim: int = 32  # per-head width; n_head * head_dim may differ from d_model
    vocab_size: int = 4096
    block_size: int = 128  # longest context (tokens, sinks not counted)
    attention: str = "sa"  # "sa": softmax attention; "xsa": exclusive self attention
    xsa_eps: float = 1e-6  # guards ||v||^2 in XSA (computed in fp32)
    xsa_layers: list[int] | None = None  # layers that use XSA; None: all. Ignored for "sa"
    xsa_gate: bool = False  # subtract tanh(alpha) x the projection, alpha per head
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
    n_sinks: int = 0  # learned attention-sink positions before the tokens
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
    bias: bool = False  # biases in Linear and LayerNorm layers
    dropout: float = 0.0
    rope_base: float = 10000.0  # RoPE frequency base
    init_std: float = 0.02
    tie_word_embeddings: bool = True  # the output layer is the token embedding
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
