"""Checkpoints: atomic writes, sharded (FSDP) files, finding the one to resume from, and loading a model from one."""
