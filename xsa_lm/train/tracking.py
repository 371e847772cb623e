"""Metric loggers: W&B (offline unless an API key is configured; never blocks or kills training) and CSV."""

import csv
import netrc
import os
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only


def has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: str) -> str:
    """'auto' -> WANDB_MODE if set, else online with an API key, else offline."""
    if mode not in ("auto", "online", "offline", "disabled"):
        from xsa_lm.errors import UserError

        raise UserError(f"logger.wandb.mode must be auto, online, offline or disabled, got {mode!r}")
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE")
    if env:
        return {"dryrun": "offline", "run": "online"}.get(env, env)
    return "online" if has_wandb_key() else "offline"


def wandb_init(
    save_dir: str,
    name: str,
    run_config: dict,
    project: str = "xsa-lm",
    entity: str | None = None,
    group: str | None = None,
    job_type: str | None = None,
    tags: list[str] | None = None,
    mode: str = "auto",
    init_timeout_s: float = 30.0,
    run_id: str | None = None,
):
    """wandb.init that never blocks or kills the caller: online init failures fall back to offline. Offline, W&B's
    own lines are off (the one line below says where the run is and how to upload it); online, they show its URL."""
    import wandb

    mode = resolve_mode(mode)
    init = dict(project=project, entity=entity, group=group, job_type=job_type, tags=list(tags or []), name=name,
                config=run_config, dir=save_dir, id=run_id, resume="allow" if run_id else None)  # fmt: skip
    try:
        run = wandb.init(
            mode=mode,
            settings=wandb.Settings(init_timeout=init_timeout_s, quiet=True, silent=mode == "offline"),
            **init,
        )
    except wandb.errors.Error as e:
        if mode != "online":
            raise
        # A key but no network (or a bad key): keep training and keep the data; upload it later.
        print(f"W&B: online init failed ({type(e).__name__}: {e}); logging offline instead")
        mode = "offline"
        run = wandb.init(mode=mode, settings=wandb.Settings(quiet=True, silent=True), **init)
    if mode == "offline":
        print(f"W&B: offline run in {Path(run.dir).parent}; upload it later with `wandb sync {Path(run.dir).parent}`")
    return run


def wandb_logger(save_dir: str, name: str, run_config: dict, **kwargs) -> WandbLogger:
    """Lightning's WandbLogger around a run made by wandb_init (same keyword arguments)."""
    return WandbLogger(experiment=wandb_init(save_dir, name, run_config, **kwargs), save_dir=save_dir)


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv; a resumed run must append to it instead."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = sorted(next(csv.reader(f), []))


class RunCSVLogger(CSVLogger):
    """metrics.csv at the top of the run directory, kept across resumes. Resuming from the checkpoint of step S
    drops the rows of steps >= S first: a run killed after its last checkpoint logged steps that are trained again,
    and the file must hold each step once."""

    def __init__(self, save_dir: str, resume_step: int | None = None) -> None:
        super().__init__(save_dir=save_dir, name="", version="")
        path = Path(save_dir) / "metrics.csv"
        if resume_step is not None and path.exists() and rank_zero_only.rank == 0:
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                header, rows = reader.fieldnames or [], list(reader)
            kept = [r for r in rows if not r.get("step") or int(float(r["step"])) < resume_step]
            tmp = path.with_suffix(".csv.tmp")
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=header)
                writer.writeheader()
                writer.writerows(kept)
            os.replace(tmp, path)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
