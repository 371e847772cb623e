"""Where this package leans on Lightning or torch beyond their public API (private names with no public equivalent,
Lightning's rules restated), in one place: tests/test_compat.py checks each, so an upgrade fails there, by name."""

import csv
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import lightning as L
import torch
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from xsa_lm.errors import WriteError, what_to_do
from xsa_lm.files import read_csv, write_csv

CHECKED_AGAINST = "lightning 2.6.6, torch 2.13.0"  # the versions every name and rule here was last checked with
COMPILED_PREFIX = "_orig_mod."  # torch.compile(model)'s wrapper's name for the model (its state-dict keys' prefix)
PRECISIONS = get_args(_PRECISION_INPUT_STR)  # the precisions Lightning's Trainer accepts, and its aliases for them
QUIET_TRAINER: dict[str, Any] = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


def quiet_srun_hint() -> None:
    """Lightning's multi-line hint, on every machine with SLURM installed, that `srun` is available but unused: noise
    outside a SLURM job, and wrong advice for a process that runs on one device by design (a bench phase)."""
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")


LIGHTNING_NOISE = (
    "litlogger",  # an advertisement
    "GPU available:",  # the header line says where the run trains
    "TPU available:",
    "HPU available:",
    "`Trainer.fit` stopped",  # the result line follows
    "`weights_only` was not set",  # said at every checkpoint
    "Restoring states from the checkpoint",  # the resume line says it
    "Restored all states from the checkpoint",
)


def quiet_third_party() -> None:
    """Messages that tell a user of this command nothing, dropped; warnings that do are kept."""
    if not os.environ.get("SLURM_JOB_ID"):  # SLURM installed but no job here: "prepend srun" would be wrong advice
        quiet_srun_hint()
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")  # inside Lightning
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")  # a resume
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from")  # a new run from a checkpoint
    # Lightning's all_gather calls torch's deprecated one (each rank, once a run): not the user's to change
    warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated")
    # The validation metrics are sums reduced over every rank before they are logged (LMModule.on_validation_epoch_end)
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('val/.*sync_dist=True")

    def noise(record: logging.LogRecord) -> bool:
        return not any(text in str(record.msg) for text in LIGHTNING_NOISE)

    for logger in (logging.getLogger("lightning.pytorch"), logging.getLogger()):
        for handler in logger.handlers:
            handler.addFilter(noise)


def accumulating(trainer: L.Trainer) -> bool:
    """Whether no optimizer step follows this micro-batch (Lightning's rule, which its DDP no_sync follows)."""
    return trainer.fit_loop._should_accumulate()


def should_update_logs(trainer: L.Trainer) -> bool:
    """Whether values logged now reach the loggers (every log_every_n_steps-th step, and the last)."""
    return trainer._logger_connector.should_update_logs


def skip_fused_update(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Fused AdamW skips its step, deciding on the device, where `found_inf` (set by GradScaler) is nonzero."""
    optimizer.found_inf = skip.float()  # type: ignore[attr-defined]  # not declared on Optimizer: set for its step


class AppendingExperimentWriter(ExperimentWriter):
    """Not Lightning's CSV writer: its __init__ deletes a resumed run's metrics.csv, and a new column rewrites the file
    in place; this one appends each save's rows (a failed append is cut off) and writes a new column's file whole."""

    def _check_log_dir_exists(self) -> None:
        pass

    def save(self) -> None:
        if not self.metrics:
            return
        path, then = Path(self.metrics_file_path), "continue with resume=auto"
        if not self.metrics_keys and path.is_file():  # a resumed run's columns: its header alone is read
            self.metrics_keys = read_csv(path)[0]
        keys = sorted(set(self.metrics_keys).union(*self.metrics))  # Lightning's order of the columns
        new = [{k: str(v) for k, v in row.items()} for row in self.metrics]
        if keys != self.metrics_keys or not path.is_file():
            rows = read_csv(path)[1] if path.is_file() else []
            write_csv(path, keys, [*rows, *new], intact="its earlier rows are intact" if rows else None, then=then)
        else:  # the usual save: only its rows are written, not the whole file again
            whole_size = path.stat().st_size
            try:
                with open(path, "a", newline="") as f:
                    csv.DictWriter(f, fieldnames=keys).writerows(new)
            except OSError as e:
                os.truncate(path, whole_size)
                raise WriteError(
                    f"could not write {path} ({e.strerror or e}); its earlier rows are intact: {what_to_do(e)}, "
                    f"then {then}"
                ) from e
        self.metrics_keys, self.metrics = keys, []


def read_distributed_checkpoint(path: Path, keys: set[str] | None = None) -> dict:
    """A torch.distributed.checkpoint directory read without a process group (`keys`: only these top-level entries)."""
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys(keys, checkpoint_id=str(path))


def skip_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Lightning broadcasts a SIGTERM flag before every micro-batch (a device wait each): Preemption replaces it."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]  # on purpose


def save_checkpoints_now(callback: ModelCheckpoint, trainer: L.Trainer) -> None:
    """A ModelCheckpoint's save at a validation's end (top-k, then last.ckpt) off its grid: no public entry."""
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def agree_on_resume_checkpoint(trainer: L.Trainer, choose: Callable[[str | None], str | None]) -> None:
    """`choose` gets each process's fit(ckpt_path=) once the process group exists and returns the one to use."""
    connector = trainer._checkpoint_connector
    restore = connector._restore_modules_and_callbacks

    def restore_agreed(checkpoint_path: str | Path | None = None, weights_only: bool | None = None) -> None:
        restore(choose(None if checkpoint_path is None else str(checkpoint_path)), weights_only)

    connector._restore_modules_and_callbacks = restore_agreed  # type: ignore[method-assign]  # on purpose


def resume_after_the_step(checkpoint: dict, *, global_step: int, accumulate: int | None = None) -> None:
    """Set as if saved at a train batch's end, that batch not completed: saved at a validation's end, a resume that
    does not validate there would number every later logged row one low. `accumulate`: this run's, which may differ
    from the checkpoint's; the micro-batch counts become what it would have run, each keeping its lag behind `ready`."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    progress, state = loop.get("epoch_loop.batch_progress"), loop.get("epoch_loop.state_dict")
    if progress is None or state is None or global_step < 1:
        return
    for counts in (progress["total"], progress["current"]):
        if counts["completed"] == counts["processed"]:
            counts["completed"] -= 1
        if accumulate is not None:
            lag = {key: counts["ready"] - counts[key] for key in ("ready", "started", "processed", "completed")}
            for key, behind in lag.items():
                counts[key] = global_step * accumulate - behind
    state["_batches_that_stepped"] = global_step - 1


def lightning_precision_name(precision: str | int) -> str:
    """Lightning's own name of a precision (`16` -> `16-mixed`), or ValueError listing the accepted ones."""
    with warnings.catch_warnings():  # its advice against an alias: the run's Trainer gives it
        warnings.simplefilter("ignore")
        return str(_convert_precision_to_unified_args(precision))  # type: ignore[arg-type]  # any value: it checks


def lightning_device_settings(**trainer_args) -> str:
    """The precision a quiet Trainer of these arguments trains in; what it refuses raises the Trainer's own errors."""
    logging.disable(logging.INFO)  # its lines (GPU available, ...) are the run's Trainer's to print
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return str(L.Trainer(**{**trainer_args, **QUIET_TRAINER}).precision)
    finally:
        logging.disable(logging.NOTSET)
