"""Checkpoints that survive crashes: atomic writes, validation before resuming, and a clean stop on preemption.

- Every checkpoint is written to <name>.tmp and renamed into place: a kill mid-write leaves the previous file whole.
- resume=auto takes the newest checkpoint that is a complete file (last.ckpt, step-*.ckpt), skipping a truncated or
  corrupt one with a warning.
- SIGTERM / SIGUSR1 (SLURM preemption, `kill`) finish the current optimizer step, write last.ckpt, and end the run
  with status `preempted` and exit code 0, so the job can be requeued with resume=auto.
- Ctrl-C (SIGINT) does the same with status `interrupted` and exit code 130; a second Ctrl-C aborts at once.
"""

import logging
import os
import pickle
import signal
import sys
import zipfile
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from xsa_lm.errors import UserError


class CheckpointWriteError(UserError):
    pass


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save straight into <path>.tmp beside the target, fsync, rename. Lightning's own save first serialises
    the whole checkpoint into memory and then goes through a temporary file elsewhere: for a large model that is a
    second copy in RAM and, across filesystems, a second copy on disk."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options")
        path = Path(path)
        tmp = path.with_name(f"{path.name}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
            os.replace(tmp, path)
        except OSError as e:  # disk full, quota, permissions: the previous checkpoint is still whole
            tmp.unlink(missing_ok=True)
            raise CheckpointWriteError(
                f"could not write checkpoint {path} ({e.strerror or e}); the previous checkpoints are intact: "
                "free space (or fix permissions) and continue with resume=auto"
            ) from None


def checkpoint_step(path: Path) -> int | None:
    """The checkpoint's global step, or None when the file is truncated or not a checkpoint."""
    try:
        with zipfile.ZipFile(path) as archive:  # torch.save files are zip archives with a CRC per member
            if archive.testzip() is not None:
                return None
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except (zipfile.BadZipFile, OSError, RuntimeError, EOFError, KeyError, ValueError, pickle.UnpicklingError):
        return None


def newest_valid_checkpoint(folder: Path) -> tuple[Path | None, int | None, list[Path]]:
    """The complete checkpoint with the highest step (last.ckpt wins ties), its step, and the corrupt ones skipped."""
    candidates = [folder / "last.ckpt", *sorted(folder.glob("step-*.ckpt"))]
    best, best_step, skipped = None, None, []
    for path in candidates:
        if not path.is_file():
            continue
        step = checkpoint_step(path)
        if step is None:
            skipped.append(path)
        elif best_step is None or step > best_step:
            best, best_step = path, step
    return best, best_step, skipped


class Preemption(L.Callback):
    """SIGTERM / SIGUSR1 / SIGINT: stop at the next optimizer step with a checkpoint, instead of dying mid-step."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, last_checkpoint: Path) -> None:
        self.last_checkpoint, self.received = last_checkpoint, None
        self.preempted_at: int | None = None
        self._seen_step = -1

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":  # a second Ctrl-C: the user will not wait
            print("\nsecond Ctrl-C: aborted without a checkpoint; resume=auto continues from the last one",
                  file=sys.stderr, flush=True)  # fmt: skip
            os._exit(130)
        if signum == signal.SIGINT:
            print("\nCtrl-C: finishing this optimizer step, then writing a checkpoint (Ctrl-C again to abort now)",
                  file=sys.stderr, flush=True)  # fmt: skip
        self.received = signal.Signals(signum).name

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning's own handlers are installed (they would end the run without a checkpoint).
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        self._seen_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step == self._seen_step:  # still accumulating micro-batches of this step
            return
        self._seen_step = trainer.global_step
        stop = self.received is not None
        if trainer.world_size > 1:  # every rank stops at the same step, or none does
            if trainer.global_step % max(trainer.log_every_n_steps, 1):
                return  # agreeing is a collective that waits for the device: at logging steps only
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop and self.preempted_at is None:
            self.preempted_at = trainer.global_step
            trainer.should_stop = True  # the loop ends after this batch; the checkpoint follows in on_train_end

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Written once the loop has closed the step (its counters complete), so a resume logs the same step numbers.
        if self.preempted_at is not None:
            trainer.save_checkpoint(self.last_checkpoint)
            if trainer.is_global_zero:
                logging.getLogger("xsa_lm.train").info(
                    f"{self.received or 'signal'} received: checkpoint at step {trainer.global_step} written to "
                    f"{self.last_checkpoint}; resume with resume=auto"
                )
