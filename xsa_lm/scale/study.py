"""What both axes of `xsa-lm scale` share: the compare seeds, and how a checked study is run and identified."""

from collections.abc import Callable
from dataclasses import dataclass

from xsa_lm.errors import UserError
from xsa_lm.sweep.protocol import check_seeds
from xsa_lm.sweep.settings import ScaleSpec, SweepSpec


def compare_seeds(scale: ScaleSpec, sweep: SweepSpec) -> tuple[list[int], list[int]]:
    """The search seeds and the compare seeds of every size (scale.seeds, else sweep.seeds), checked as the sweep
    checks them, under the name the user set."""
    name = "scale.seeds" if scale.seeds is not None else "sweep.seeds"
    listed = scale.seeds if scale.seeds is not None else sweep.seeds
    seeds = check_seeds(listed, sweep.search_seeds, sweep.reuse_search_run, name=name)
    if not seeds:
        raise UserError(f"{name}=[]: the study compares SA and XSA at every size, which needs compare seeds")
    return sweep.search_seeds, seeds


@dataclass(frozen=True)
class StudyIdentity:
    """How both axes' results.json open: the study's folder, its id (scale.json's) and the overrides of its runs."""

    study_dir: str
    study_id: str
    overrides: list[str]


Study = Callable[[StudyIdentity, str | None], list[str]]  # runs a checked study: its identity, the W&B group
