"""Metric loggers: W&B (offline unless an API key is configured; never blocks or kills training) and CSV."""

import netrc
import os
import re
import shutil
import socket
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from xsa_lm.compat import AppendingExperimentWriter
from xsa_lm.errors import UserError, first_line
from xsa_lm.files import read_csv, write_csv

if TYPE_CHECKING:  # wandb itself loads only when a W&B run is made
    from wandb import Run


WandbMode = Literal["online", "offline", "disabled", "shared"]
WANDB_ENV_MODES = {"dryrun": "offline", "run": "online"} | {mode: mode for mode in get_args(WandbMode)}  # W&B's aliases


def resolve_mode(mode: str) -> WandbMode:
    """'auto' -> WANDB_MODE if set, else online with an API key, else offline; an unknown WANDB_MODE is refused."""
    if mode not in ("auto", "online", "offline", "disabled"):
        raise UserError(f"logger.wandb.mode must be auto, online, offline or disabled, got {mode!r}")
    env = os.environ.get("WANDB_MODE")
    if env and env not in WANDB_ENV_MODES:
        raise UserError(
            f"the environment variable WANDB_MODE={env!r} is no W&B mode: set it to online, offline or disabled, "
            "or unset it (logger.wandb.mode=auto then logs online with an API key, else offline)"
        )
    if mode != "auto":
        return cast(WandbMode, mode)
    if env:
        return cast(WandbMode, WANDB_ENV_MODES[env])
    try:  # an API key: in the environment or ~/.netrc (`wandb login`)
        key = bool(os.environ.get("WANDB_API_KEY")) or netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        key = False
    return "online" if key else "offline"


def unreachable(base_url: str, timeout_s: float = 3.0) -> str | None:
    """Why the server at base_url (or its proxy) takes no connection within timeout_s, else None."""
    url = urllib.parse.urlsplit(base_url)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    address = (url.hostname or "", url.port or (443 if url.scheme == "https" else 80))
    why: list[str | None] = [f"no answer within {timeout_s:g} s"]

    def connect() -> None:
        try:
            socket.create_connection(address, timeout=timeout_s).close()
            why[0] = None
        except OSError as e:  # no such host, refused, timed out, no route
            why[0] = str(e.strerror or e)

    probe = threading.Thread(target=connect, daemon=True)  # a name lookup has no timeout of its own
    probe.start()
    probe.join(timeout_s)
    return None if why[0] is None else f"{address[0]}:{address[1]}: {why[0]}"


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
    """wandb.init that never blocks or kills the caller: an online init that fails falls back to offline, in one line
    that says where the run is and how to upload it."""
    import wandb

    mode = resolve_mode(mode)
    init: dict[str, Any] = dict(project=project, entity=entity, group=group, job_type=job_type, tags=list(tags or []))
    init |= dict(name=name, config=run_config, dir=save_dir, id=run_id, resume="allow" if run_id else None)
    # A key but no network, or a bad key: keep training and keep the data, offline; upload it later.
    why_offline = unreachable(wandb.setup().settings.base_url) if mode == "online" else None
    if why_offline is None:
        folder = Path(save_dir) / "wandb"
        before = set(folder.glob("run-*"))
        try:
            settings = wandb.Settings(init_timeout=init_timeout_s, quiet=True, silent=mode == "offline")
            run = wandb.init(mode=mode, settings=settings, **init)
        except wandb.errors.Error as e:
            if mode != "online":
                raise
            why_offline = f"online init failed ({type(e).__name__}: {first_line(e)})"
            for failed in set(folder.glob("run-*")) - before:  # the online attempt's folder holds nothing to keep
                shutil.rmtree(failed, ignore_errors=True)
    if why_offline is not None:
        run = wandb.init(mode="offline", settings=wandb.Settings(quiet=True, silent=True), **init)
    where = Path(run.dir).parent
    if why_offline is not None or mode == "offline":
        said = f"{why_offline}; logging offline in {where}:" if why_offline else f"offline run in {where};"
        print(f"W&B: {said} upload it later with `wandb sync {where}`")
    return run


class RunWandbLogger(WandbLogger):
    """log_model uploads the val/loss callback's checkpoints only (the step ones would take the `best` alias)."""

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        if getattr(checkpoint_callback, "monitor", None) == "val/loss":
            super().after_save_checkpoint(checkpoint_callback)


def wandb_logger(
    save_dir: str, name: str, run_config: dict, log_model: bool | Literal["all"] = False, **kwargs
) -> RunWandbLogger:
    """Lightning's WandbLogger around a run made by wandb_init: every curve over tokens seen (runs of other batch
    sizes line up), and val/loss summarised by its minimum beside its last value."""
    run = wandb_init(save_dir, name, run_config, **kwargs)
    run.define_metric("trainer/global_step")
    run.define_metric("train/tokens_seen")
    run.define_metric("*", step_metric="train/tokens_seen")
    run.define_metric("val/loss", summary="min,last")
    return RunWandbLogger(experiment=run, save_dir=save_dir, log_model=log_model)


def log_files_artifact(run: "Run", name: str, artifact_type: str, files: list[Path]) -> None:
    """The files that exist, as a new version of the run's artifact `name` (copied aside when logged)."""
    import wandb

    artifact = wandb.Artifact(name=re.sub(r"[^\w.-]", "-", name), type=artifact_type)  # W&B's allowed characters
    for path in files:
        if path.is_file():
            artifact.add_file(str(path), name=path.name)
    run.log_artifact(artifact)


class RunCSVLogger(CSVLogger):
    """Not Lightning's CSVLogger, which deletes a resumed run's metrics.csv: a resume at step S keeps it, less the
    rows of steps >= S (trained again)."""

    def __init__(self, save_dir: str, resume_step: int | None = None) -> None:
        super().__init__(save_dir=save_dir, name="", version="")
        path = Path(save_dir) / "metrics.csv"
        rank = rank_zero_only.rank  # type: ignore[attr-defined]  # a function attribute Lightning sets
        if resume_step is not None and path.exists() and rank == 0:
            header, rows = read_csv(path)
            write_csv(path, header, [r for r in rows if not r.get("step") or int(float(r["step"])) < resume_step])

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:  # finalize saves it only if made: a process that logged nothing saves nothing
            self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return cast(ExperimentWriter, self._experiment)
