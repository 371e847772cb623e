"""Pure-torch model code: no Lightning, Hydra, W&B or file I/O."""

from xsa_lm.model.attention import CausalSelfAttention, KVCache
from xsa_lm.model.config import GPTConfig
from xsa_lm.model.generate import generate
from xsa_lm.model.gpt import GPT
from xsa_lm.model.xsa import ExclusiveSelfAttention, exclusive_projection, xsa_reference

__all__ = [
    "GPT",
    "GPTConfig",
    "CausalSelfAttention",
    "ExclusiveSelfAttention",
    "KVCache",
    "exclusive_projection",
    "generate",
    "xsa_reference",
]
