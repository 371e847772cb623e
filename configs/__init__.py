"""The config tree, as the package xsa_lm.configs (Hydra reads it by pkg://xsa_lm.configs)."""
