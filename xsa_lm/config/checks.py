"""A command's own true-or-false options read off its composed config (the training config's are its spec's)."""

from collections.abc import Iterable

from omegaconf import DictConfig

from xsa_lm.errors import UserError


def check_switches(cfg: DictConfig, *, keys: Iterable[str]) -> None:
    """A text such as `no` would count as true."""
    for key in keys:
        if not isinstance(cfg[key], bool):
            raise UserError(f"{key} must be true or false, got {cfg[key]!r}")
