"""Pure-torch model code: no Lightning, Hydra, W&B or file I/O."""

from xsa_lm.model.attention import CausalSelfAttention, exclusive_projection
from xsa_lm.model.config import GPTConfig
from xsa_lm.model.gpt import GPT

__all__ = ["GPT", "GPTConfig", "CausalSelfAttention", "exclusive_projection"]
