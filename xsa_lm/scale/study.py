"""What both axes of `xsa-lm scale` share: the compare seeds, and how a checked study is run and identified."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from omegaconf import DictConfig, OmegaConf

from xsa_lm.errors import UserError
from xsa_lm.sweep.protocol import check_search_seeds, check_seeds
from xsa_lm.sweep.settings import plain


def compare_seeds(cfg: DictConfig) -> tuple[list[int], list[int]]:
    """The search seeds and the compare seeds of every size (scale.seeds, else sweep.seeds), checked as the sweep
    checks them, under the name the user set."""
    name = "scale.seeds" if cfg.scale.seeds is not None else "sweep.seeds"
    search_seeds = check_search_seeds(plain(cfg.sweep.search_seeds))
    listed = cast(list[int] | None, plain(OmegaConf.select(cfg, name)))
    seeds = check_seeds(listed, search_seeds, cfg.sweep.reuse_search_run, name=name)
    if not seeds:
        raise UserError(f"{name}=[]: the study compares SA and XSA at every size, which needs compare seeds")
    return search_seeds, seeds


@dataclass(frozen=True)
class StudyIdentity:
    """How both axes' results.json open: the study's folder, its id (scale.json's) and the overrides of its runs."""

    study_dir: str
    study_id: str
    overrides: list[str]


Study = Callable[[StudyIdentity, str | None], list[str]]  # runs a checked study: its identity, the W&B group
