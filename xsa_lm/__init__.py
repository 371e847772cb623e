"""xsa-lm: pretrain GPT-style models with baseline (SA) or exclusive (XSA) self attention."""

__version__ = "0.1.0"
