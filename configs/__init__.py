"""The config tree, as the package xsa_lm.configs. Hydra imports it before it reads a config: the typed schemas of
the training config and its groups are registered here, so every composition (CLI, tests, sweeps) sees them."""

from xsa_lm.config.schema import register

register()
