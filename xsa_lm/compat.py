"""Every private Lightning or torch API this package relies on, in one place.

Each has no public equivalent; tests/test_compat.py checks each against the installed versions, so an upgrade that
removes or changes one fails there, by name, rather than deep inside a training run.
"""

import csv
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import cast

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from xsa_lm.errors import WriteError, what_to_do
from xsa_lm.files import atomic_file


def should_update_logs(trainer: L.Trainer) -> bool:
    """Whether this step's logged values reach the loggers: Lightning's own rule (its LearningRateMonitor reads it
    the same way), which has no public accessor."""
    return trainer._logger_connector.should_update_logs


def skip_fused_update(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Fused Adam/AdamW leave parameters and state untouched where `optimizer.found_inf` is nonzero, deciding on the
    device: the attribute GradScaler sets for them, read by torch's fused step."""
    optimizer.found_inf = skip.float()  # type: ignore[attr-defined]  # not declared on Optimizer: set for its step


def saves_sharded_checkpoints(strategy: ModelParallelStrategy) -> bool:
    """ModelParallelStrategy(save_distributed_checkpoint=...) keeps the flag only in a private attribute."""
    return strategy._save_distributed_checkpoint


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, continuing an existing metrics.csv (a resumed run): the stock writer's __init__ calls
    `_check_log_dir_exists`, which deletes the file."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = sorted(next(csv.reader(f), []))

    def save(self) -> None:
        """Lightning's, but a write that fails (a full disk) leaves metrics.csv whole: the rows it was appending are
        cut off again, and a new header (a metric logged for the first time) is written through a temporary file
        (Lightning's rewrite truncates the file first)."""
        path = Path(self.metrics_file_path)
        self._whole_size = path.stat().st_size if path.is_file() else None
        try:
            super().save()
        except OSError as e:
            if self._whole_size is None:
                path.unlink(missing_ok=True)
            else:
                os.truncate(path, self._whole_size)
            raise WriteError(
                f"could not write {path} ({e.strerror or e}); its earlier rows are intact: {what_to_do(e)}, then "
                "continue with resume=auto"
            ) from e

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with open(self.metrics_file_path, newline="") as f:
            rows = list(csv.DictReader(f))
        intact, then = "its earlier rows are intact", "continue with resume=auto"
        with atomic_file(self.metrics_file_path, "w", newline="", intact=intact, then=then) as f:
            writer = csv.DictWriter(f, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)
        self._whole_size = Path(self.metrics_file_path).stat().st_size  # what a failed append is cut back to


def appending_csv_writer(logger: CSVLogger) -> ExperimentWriter:
    """CSVLogger.experiment, with an AppendingExperimentWriter: the logger keeps its writer in `_experiment`."""
    if logger._experiment is None:
        logger._experiment = AppendingExperimentWriter(log_dir=logger.log_dir)
    return cast(ExperimentWriter, logger._experiment)  # declared as Fabric's writer, the base of Lightning's


def read_distributed_checkpoint(path: Path, keys: set[str] | None = None) -> dict:
    """A torch.distributed.checkpoint directory read whole into this process, without a process group (`keys`: only
    these top-level entries). What torch's format_utils.dcp_to_torch_save does, which only offers to write a file."""
    state: dict = {}
    planner = _EmptyStateDictLoadPlanner(keys=keys)
    _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=planner, no_dist=True)
    return state


def skip_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Lightning's training loop broadcasts a SIGTERM flag from rank 0 before every micro-batch of a multi-process
    run and reads it on the host (`.item()`): a wait for the device per micro-batch. The run's Preemption callback
    replaces Lightning's signal handling and agrees on stopping at logging steps only: the broadcast is switched off
    on this trainer's loop (`_TrainingEpochLoop._broadcast_sigterm_tensor`)."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]  # on purpose


def accumulating(trainer: L.Trainer) -> bool:
    """Whether the current micro-batch's gradients are accumulated, not yet followed by an optimizer step: Lightning's
    own rule (end of the accumulation window or of the epoch), which its DDP no_sync follows; no public accessor."""
    return trainer.fit_loop._should_accumulate()


def save_checkpoints_now(callback: ModelCheckpoint, trainer: L.Trainer) -> None:
    """What a ModelCheckpoint does at the end of a validation (its top-k checkpoint, then last.ckpt), outside the fit
    loop: for a last step validated after the fit. The two steps have no public entry point."""
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def agree_on_resume_checkpoint(trainer: L.Trainer, choose: Callable[[str | None], str | None]) -> None:
    """Lightning reads fit(ckpt_path=...) in every process on its own; `choose` (e.g. rank 0's path, broadcast) sees
    each process's path once the process group exists and returns the one to restore. The restore call it wraps,
    `_CheckpointConnector._restore_modules_and_callbacks`, is where fit hands the path over, after the setup hooks."""
    connector = trainer._checkpoint_connector
    restore = connector._restore_modules_and_callbacks

    def restore_agreed(checkpoint_path: str | Path | None = None, weights_only: bool | None = None) -> None:
        restore(choose(None if checkpoint_path is None else str(checkpoint_path)), weights_only)

    connector._restore_modules_and_callbacks = restore_agreed  # type: ignore[method-assign]  # on purpose


def realign_accumulation(checkpoint: dict, *, global_step: int, accumulate: int) -> None:
    """A checkpoint counts the micro-batches each process has run (global_step x the accumulation it trained with),
    and Lightning closes an accumulation window when that count is a multiple of the current accumulation. A run
    resumed with another accumulation (another number of devices, another micro-batch size) would take its first
    steps after a partial window: the count is set to what this accumulation would have run. Each counter keeps its
    lag behind `ready`: a checkpoint saved at a train batch's end (every_n_steps) has that batch not yet completed,
    which is how Lightning tells it apart on restore (and counts the step its loggers write). The loop counters live
    in the checkpoint's private `loops` layout."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if progress is None:
        return
    for counts in (progress["total"], progress["current"]):
        lag = {key: counts["ready"] - counts[key] for key in ("ready", "started", "processed", "completed")}
        for key, behind in lag.items():
            counts[key] = global_step * accumulate - behind


def lightning_precisions() -> tuple[str, ...]:
    """The precision names Lightning's Trainer accepts (besides aliases such as `16`): its own type's values."""
    from typing import get_args

    from lightning.fabric.connector import _PRECISION_INPUT_STR

    return get_args(_PRECISION_INPUT_STR)


def lightning_precision_name(precision: str | int) -> str:
    """Lightning's own name of a precision it accepts (`16` -> `16-mixed`, `bf16` -> `bf16-mixed`, `32` ->
    `32-true`), or ValueError listing the accepted ones: Trainer's conversion, which has no public entry point."""
    from lightning.fabric.connector import _convert_precision_to_unified_args

    with warnings.catch_warnings():  # an accepted but discouraged alias: the Trainer warns once, later
        warnings.simplefilter("ignore")
        name = _convert_precision_to_unified_args(precision)  # type: ignore[arg-type]  # any value: it checks
    return cast(str, name)


def lightning_device_settings(**trainer_args) -> str:
    """What Lightning's Trainer decides from its accelerator, devices, num_nodes, strategy and precision arguments,
    without building a Trainer: the same checks (an unknown name, an accelerator this machine lacks, a device count
    it cannot use, a combination it refuses) raise the same errors, and it returns the precision the run would
    train in (Lightning may change it, e.g. 16-mixed on CPU runs bf16-mixed). `_AcceleratorConnector` is the part
    of Trainer.__init__ that does this; its warnings and info lines are left to the Trainer, which repeats them."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            connector = _AcceleratorConnector(**trainer_args)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    return str(connector.precision_plugin.precision)
