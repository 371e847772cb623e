"""Every private Lightning or torch API this package relies on, in one place.

Each has no public equivalent; tests/test_compat.py checks each against the installed versions, so an upgrade that
removes or changes one fails there, by name, rather than deep inside a training run.
"""

import csv
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict


def should_update_logs(trainer: L.Trainer) -> bool:
    """Whether this step's logged values reach the loggers: Lightning's own rule (its LearningRateMonitor reads it
    the same way), which has no public accessor."""
    return trainer._logger_connector.should_update_logs


def skip_fused_update(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Fused Adam/AdamW leave parameters and state untouched where `optimizer.found_inf` is nonzero, deciding on the
    device: the attribute GradScaler sets for them, read by torch's fused step."""
    optimizer.found_inf = skip.float()


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


def appending_csv_writer(logger: CSVLogger) -> ExperimentWriter:
    """CSVLogger.experiment, with an AppendingExperimentWriter: the logger keeps its writer in `_experiment`."""
    if logger._experiment is None:
        logger._experiment = AppendingExperimentWriter(log_dir=logger.log_dir)
    return logger._experiment


def read_distributed_checkpoint(path: Path, keys: set[str] | None = None) -> dict:
    """A torch.distributed.checkpoint directory read whole into this process, without a process group (`keys`: only
    these top-level entries). What torch's format_utils.dcp_to_torch_save does, which only offers to write a file."""
    state: dict = {}
    planner = _EmptyStateDictLoadPlanner(keys=keys)
    _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=planner, no_dist=True)
    return state
