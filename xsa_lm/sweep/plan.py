"""`xsa-lm plan`: a training config's memory per device and largest micro-batch (train/plan.py), and the GPU-hours of
its run on one H100; of every trial by phase where the config is a sweep's study (an experiment that sets sweep.*)."""

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any

import hydra
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from xsa_lm.config.spec import VALUES_ONLY, Spec, TrainSpec, parse, rule
from xsa_lm.errors import UserError, one_line_errors
from xsa_lm.files import check_new_file, write_json
from xsa_lm.sweep.run import grid_and_seeds, study_phases
from xsa_lm.sweep.settings import SweepSpec
from xsa_lm.train import memory
from xsa_lm.train.plan import attention_kernels, gpu_hours_table, make_plan, run_compute, run_shape, table


def _gib(value: Any) -> str | None:
    positive = not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf
    return None if value is None or positive else "must be a positive number of GiB"


def _mfu(value: Any) -> str | None:
    share = not isinstance(value, bool) and isinstance(value, int | float) and 0 < value <= 1
    return None if value is None or share else "must be a share of the peak FLOP/s, e.g. 0.4, or null"


class PlanOptions(Spec):
    """configs/plan.yaml's keys beside the training config's."""

    device_memory_gb: Annotated[float | int | None, rule(_gib)] = None
    activation_checkpointing: bool
    mfu: Annotated[float | None, rule(_mfu)] = None  # null: the one measured for the model (train/plan.py)
    out: Any = None  # a path (Hydra reads out=2024 as a number)
    overwrite: bool = False


def study_runs(cfg: DictConfig) -> dict[str, int] | None:
    """Runs by phase where the config sets sweep.*, the sweep's (composed as `xsa-lm sweep` would); else None."""
    if "sweep" not in cfg or "scale" in cfg:  # a scale study's runs differ in length: one run's hours only
        return None
    overrides = HydraConfig.get().overrides.task
    study = compose("sweep", [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in PlanOptions.model_fields])
    spec = parse(SweepSpec, study.sweep, at="sweep.")
    return {phase.name: phase.runs for phase in study_phases(spec, *grid_and_seeds(spec, study.model.name))}


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="plan")
@one_line_errors
def main(cfg: DictConfig) -> None:  # a UserError ends in one line: one_line_errors
    options = parse(PlanOptions, {key: cfg[key] for key in PlanOptions.model_fields})
    if options.out == "":
        raise UserError("out= is empty: give the file to write the plan to, e.g. out=plan.json, or leave out= out")
    out = None if options.out is None else Path(str(options.out))
    if out is not None:
        check_new_file(out, overwrite=options.overwrite, example="plan.json")
    spec = parse(TrainSpec, cfg, VALUES_ONLY)  # the batch that does not split is a row of the plan, not a refusal
    run = replace(run_shape(spec), activation_checkpointing=options.activation_checkpointing)  # plan.yaml's
    gib, accelerator = options.device_memory_gb, spec.trainer.accelerator
    available, where = (
        memory.available_bytes(accelerator) if gib is None else (int(gib * memory.GIB), f"device_memory_gb={gib:g}")
    )
    sdpa = attention_kernels(spec.sdpa_backends, accelerator=accelerator)
    plan = make_plan(run, model_name=spec.model.name, available=available, available_from=where, sdpa=sdpa)
    runs = study_runs(cfg)
    if out is not None:
        write_json(out, asdict(plan))
    print(table(plan))
    print(f"\n{gpu_hours_table(run_compute(spec, options.mfu), runs, given_mfu=options.mfu is not None)}")
