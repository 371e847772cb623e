"""GPTConfig: every architectural choice of the decoder, with the paper's defaults."""

import importlib
import inspect
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

# The attention variants xsa-lm ships, by option name (configs/attention/<name>.yaml gives the same _target_).
BUILT_IN = {"sa": "xsa_lm.model.attention.CausalSelfAttention", "xsa": "xsa_lm.model.xsa.ExclusiveSelfAttention"}
UNSET: Any = object()  # a legacy field not given


@dataclass
class GPTConfig:
    n_layer: int = 4  # transformer blocks
    d_model: int = 128  # residual stream width
    n_head: int = 4  # attention heads
    head_dim: int = 32  # per-head width; n_head * head_dim may differ from d_model (paper)
    vocab_size: int = 4096  # tokenizer vocabulary, padded to a multiple of 64 by the caller
    block_size: int = 128  # longest context the model supports (RoPE tables are built for it)
    attention: str = "sa"  # the attention variant's name: sa (softmax), xsa (exclusive), or a lab's own
    attention_target: str = ""  # its class by import path (a CausalSelfAttention subclass); "": the built-in
    attention_options: dict[str, Any] = field(default_factory=dict)  # its constructor's keyword arguments
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head (paper)
    n_sinks: int = 0  # learned attention-sink tokens prepended inside the model (paper's Figure 6: 0, 1, 4)
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
    bias: bool = False  # biases in Linear and LayerNorm layers (nanoGPT's option; paper: not stated)
    dropout: float = 0.0  # pretraining on ~1 epoch of data needs none
    rope_base: float = 10000.0  # RoPE frequency base
    init_std: float = 0.02  # N(0, init_std); residual projections get init_std / sqrt(2 n_layer)
    loss_chunk: int = 0  # tokens per chunk of the cross-entropy (loss.py), not the whole logits at once; 0: whole
    # A model config saved before variants were classes: XSA's options as fields (None layers: all; ignored for sa).
    xsa_eps: InitVar[float] = UNSET
    xsa_layers: InitVar[tuple[int, ...] | None] = UNSET
    xsa_gate: InitVar[bool] = UNSET

    def __post_init__(self, xsa_eps: float, xsa_layers: tuple[int, ...] | None, xsa_gate: bool) -> None:
        if any(value is not UNSET for value in (xsa_eps, xsa_layers, xsa_gate)):
            self.attention_target, self.attention_options = BUILT_IN.get(self.attention, ""), {}
            if self.attention == "xsa":
                layers = "all" if xsa_layers in (None, UNSET) else list(xsa_layers)
                eps = {} if xsa_eps is UNSET else {"eps": xsa_eps}
                self.attention_options = {**eps, "layers": layers, "gate": "tanh" if xsa_gate is True else "none"}
        if not self.attention_target:
            if self.attention not in BUILT_IN:
                raise ValueError(
                    f"attention={self.attention!r} is no built-in variant ({', '.join(BUILT_IN)}): give its "
                    "class as attention_target"
                )
            self.attention_target = BUILT_IN[self.attention]
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        # Each refusal opens with its field: config/spec.py ModelSpec.gpt_config names the config key by it.
        positive = ("n_layer", "d_model", "n_head", "head_dim", "vocab_size", "block_size", "mlp_ratio", "rope_base")
        for name in (*positive, "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk={self.loss_chunk} must be >= 0 (0: the whole logits at once)")
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
        self.check_attention()

    @property
    def attention_class(self) -> Any:  # type[CausalSelfAttention]
        """The variant's class, imported from attention_target; a ValueError in one line if it is none."""
        module, _, name = self.attention_target.rpartition(".")
        prefix = f"attention_target={self.attention_target}"
        if not module:
            raise ValueError(f"{prefix} must name a class by its module, e.g. lab_attention.gated.GatedAttention")
        try:
            found = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{prefix} cannot be imported ({e}): put its package on PYTHONPATH") from None
        # A subclass of SA's class, found by name along its MRO: attention.py imports this module, not the reverse.
        if not (
            isinstance(found, type) and any(f"{c.__module__}.{c.__qualname__}" == BUILT_IN["sa"] for c in found.__mro__)
        ):
            raise ValueError(f"{prefix} is not an attention variant (a subclass of CausalSelfAttention)")
        return found

    def check_attention(self) -> None:
        """The variant takes these options and accepts their values: its signature, then its constructor run for one
        layer on the meta device (no memory, no random numbers). Its refusals open with `attention.<option>`. The
        options are then kept with their defaults filled in, in the variant's settled form."""
        cls, options = self.attention_class, self.attention_options
        try:
            bound = inspect.signature(cls).bind(self, 0, **options)
        except TypeError:
            known = cls.option_names()
            unknown = ", ".join(k for k in options if k not in known) or ", ".join(options)
            raise ValueError(
                f"attention.{unknown}: {self.attention} ({self.attention_target}) takes no such option "
                f"(its options: {', '.join(known) or 'none'})"
            ) from None
        bound.apply_defaults()
        given = dict(list(bound.arguments.items())[2:])  # after config and layer
        try:
            with torch.device("meta"):
                cls(self, 0, **options)
            self.attention_options = cls.settled_options(self, given)
        except ValueError as e:
            raise ValueError(f"attention.{e}") from None
