"""xsa-lm: pretrain GPT-style models with baseline (SA) or exclusive (XSA) self attention."""

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here

from omegaconf import OmegaConf

# ${idiv:a,b} in configs: integer division, e.g. a micro-batch that keeps tokens per forward pass constant.
OmegaConf.register_new_resolver("idiv", lambda a, b: int(a) // int(b), replace=True)
