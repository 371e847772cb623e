"""Checkpoints that survive crashes: each written to <name>.tmp and renamed into place (a sharded one by rank 0 once
every shard is written); one payload per event, last.ckpt and best.ckpt hard links to it (they outlive its pruning);
a failure in rank 0's part raises on every rank at once."""

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import cast

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch.distributed.tensor import DTensor

from xsa_lm.checkpoints.sharded import META, is_sharded, load_sharded
from xsa_lm.compat import save_checkpoints_now
from xsa_lm.errors import UserError, WriteError
from xsa_lm.files import atomic_file


class CheckpointWriteError(WriteError):
    """A checkpoint that could not be written (the previous ones are whole)."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save straight into <path>.tmp, fsync, rename. Not Lightning's TorchCheckpointIO.save_checkpoint: it
    serialises to memory first (a second copy) and writes in place."""

    def save_checkpoint(self, checkpoint: dict, path: str | Path, storage_options: object = None) -> None:
        # A full disk, a quota, a file-size limit, permissions: the .tmp goes, the previous checkpoints are whole.
        path = Path(path)
        earlier = path.parent.is_dir() and any(path.parent.glob("*.ckpt"))
        intact = "the previous checkpoints are intact" if earlier else "no checkpoint was written yet"
        try:
            with atomic_file(path, "wb", intact=intact, then="continue with resume=auto", place=move_into_place) as f:
                torch.save(checkpoint, f)
        except WriteError as e:
            raise CheckpointWriteError(str(e)) from None

    def load_checkpoint(
        self, path: str | Path, map_location: Callable | None = None, weights_only: bool | None = None
    ) -> dict:
        if is_sharded(Path(path)):  # written by FSDP2 ranks, resumed here by one process (or DDP)
            return load_sharded(Path(path))
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


class AtomicDDPStrategy(DDPStrategy):
    """Not Lightning's DDPStrategy: a failed checkpoint write on rank 0 fails every rank at once (Lightning's leaves
    them waiting at a barrier)."""

    def save_checkpoint(self, checkpoint: dict, filepath: str | Path, storage_options: object = None) -> None:
        on_rank_zero(self, lambda: self.checkpoint_io.save_checkpoint(checkpoint, filepath), f"writing {filepath}")


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """Not Lightning's ModelParallelStrategy: its shards are written in place (a kill leaves a torn checkpoint); these
    go to <name>.tmp/, renamed by rank 0 once all are written. async_save: written in the background, the rename and
    links (`when_written`) follow at the next save or teardown."""

    def __init__(self, *, save_distributed_checkpoint: bool = True, async_save: bool = False, **kwargs) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.sharded = save_distributed_checkpoint  # Lightning keeps it only in a private attribute
        self.async_save = async_save
        self._pending: tuple | None = None  # (future, tmp, path, [actions after the rename])
        self._checkpoint_group = None  # async writes agree over a group of their own, beside training's

    def save_checkpoint(self, checkpoint: dict, filepath: str | Path, storage_options: object = None) -> None:
        self.finish_pending_checkpoint()
        path = Path(self.broadcast(str(filepath)))  # rank 0's path: all ranks write into the same directory
        if not self.sharded:
            # Gathered on rank 0 (a collective every rank joined); Lightning's save would first delete a sharded
            # directory of this name, leaving no checkpoint for a moment.
            on_rank_zero(self, lambda: self.checkpoint_io.save_checkpoint(checkpoint, path), f"writing {path}")
            return
        tmp = path.with_name(f"{path.name}.tmp")
        on_rank_zero(self, lambda: remove(tmp), f"removing {tmp}")  # left by a run killed mid-write
        if self.async_save:
            self._pending = (self._start_async_save(checkpoint, tmp), tmp, path, [])
            return
        super().save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        self.put_in_place(tmp, path)

    def put_in_place(self, tmp: Path, path: Path) -> None:
        """Once every rank's shard is written: meta.pt fsynced (torch.distributed.checkpoint fsyncs the shards)."""
        self.barrier("every shard written")

        def finish() -> None:
            with open(tmp / META, "rb") as f:
                os.fsync(f.fileno())
            move_into_place(tmp, path)

        on_rank_zero(self, finish, f"putting checkpoint {path} in place")

    def _start_async_save(self, checkpoint: dict, tmp: Path) -> object:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        tmp.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}  # the layout ModelParallelStrategy's save writes
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        future = dcp.async_save(state, checkpoint_id=tmp, process_group=self._checkpoint_group)
        if self.is_global_zero:
            torch.save(checkpoint, tmp / META)
        return future

    def when_written(self, action: Callable[[], None], what: str) -> None:
        """Run `action` on rank 0 once the checkpoint being written is in place (now, when none is)."""
        if self._pending is None:
            on_rank_zero(self, action, what)
        else:
            self._pending[3].append((action, what))

    def finish_pending_checkpoint(self) -> None:
        if self._pending is None:
            return
        future, tmp, path, after = self._pending
        self._pending = None
        future.result()  # this rank's shard and, on rank 0, .metadata
        self.put_in_place(tmp, path)
        for action, what in after:
            on_rank_zero(self, action, what)

    def teardown(self) -> None:
        self.finish_pending_checkpoint()  # the end of the fit (or validate) waits for the last checkpoint
        super().teardown()


class AsyncSave(L.Callback):
    """checkpoint.async_save (sharded checkpoints only: TrainSpec's rule), switched on in the strategy before a save."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        cast(AtomicModelParallelStrategy, trainer.strategy).async_save = True


def on_rank_zero(strategy: Strategy, action: Callable[[], None], what: str) -> None:
    """A filesystem step on rank 0 whose failure raises on every rank (not at a barrier's 30-minute timeout)."""
    error = None
    if strategy.is_global_zero:
        try:
            action()
        except Exception as e:  # re-raised below, on every rank
            error = str(e) if isinstance(e, UserError) else f"{what} failed on rank 0: {type(e).__name__}: {e}"
    error = strategy.broadcast(error)
    if error is not None:
        raise CheckpointWriteError(error)


def remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def move_into_place(tmp: Path, path: Path) -> None:
    """Rename tmp to path; an old directory is renamed aside to <name>.old first (resume=auto finds it)."""
    if path.exists() and (path.is_dir() or tmp.is_dir()):
        old = path.with_name(f"{path.name}.old")
        remove(old)
        os.rename(path, old)
        os.rename(tmp, path)
        remove(old)
    else:
        os.replace(tmp, path)


def link_or_copy(source: Path, target: Path) -> None:
    """target becomes a hard link to source (a directory: of links), atomically; a copy without hard links."""
    ours, theirs = (p / META if p.is_dir() else p for p in (source, target))
    if theirs.exists() and ours.exists() and os.path.samefile(ours, theirs):  # already (rename would leave both)
        return
    tmp = target.with_name(f"{target.name}.tmp")
    for link in (os.link, shutil.copy2):  # no hard links on some FUSE / object-store mounts: a copy, then
        remove(tmp)
        try:
            shutil.copytree(source, tmp, copy_function=link) if source.is_dir() else link(source, tmp)
            break
        except BaseException as e:
            remove(tmp)  # a full disk or Ctrl-C mid-copy: no partial copy stays
            if link is shutil.copy2 or not isinstance(e, OSError):
                raise
            warnings.warn(f"cannot hard-link {source} to {target} ({e.strerror or e}); copying it", stacklevel=2)
    move_into_place(tmp, target)


class FolderCheckpoint(ModelCheckpoint):
    """ModelCheckpoint with fixed names (never best-v1.ckpt) whose kept files follow a run folder that was moved."""

    def __init__(self, **kwargs) -> None:
        super().__init__(enable_version_counter=False, **kwargs)
        self.restored_step: int | None = None
        self.dropped: list[str] = []  # step checkpoints past keep_last at a resume: removed as training starts

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.restored_step = checkpoint.get("global_step")  # before load_state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Lightning forgets the kept checkpoints of a moved run folder (keep_last never prunes them, best.ckpt is
        replaced by the next validation): read them in the new place. Another run's checkpoint keeps none."""
        old, new = state_dict.get("dirpath"), self.dirpath
        kept = [state_dict.get(key) for key in ("best_model_path", "last_model_path")]
        if old and new and Path(old) != Path(new) and any(p and (Path(new) / Path(p).name).exists() for p in kept):
            moved = lambda path: str(Path(new) / Path(path).name) if path else path  # noqa: E731
            paths = ("best_model_path", "kth_best_model_path", "last_model_path")
            state_dict = {**state_dict, "dirpath": new} | {key: moved(state_dict.get(key)) for key in paths}
            state_dict["best_k_models"] = {moved(p): v for p, v in state_dict.get("best_k_models", {}).items()}
        super().load_state_dict(state_dict)
        if self.monitor == "step" and self.save_top_k >= 0 and self.restored_step is not None:
            # Keep the newest step checkpoints on disk, the restored step's included (a link to best.ckpt saved
            # before this callback counted it); drop older ones (a lower keep_last).
            restored = self.format_checkpoint_name({"step": torch.tensor(self.restored_step)})
            known = {**self.best_k_models, restored: torch.tensor(self.restored_step)}
            ordered = sorted(((p, s) for p, s in known.items() if Path(p).exists()), key=lambda item: float(item[1]))
            cut = max(len(ordered) - self.save_top_k, 0)
            # never the file resumed from (keep_last=0), nor one outside this run's folder
            here = Path(str(self.dirpath))
            self.dropped = [path for path, _ in ordered[:cut] if path != restored and Path(path).parent == here]
            self.best_k_models = dict(ordered[cut:])
            if ordered[cut:]:
                self.kth_best_model_path, self.kth_value = ordered[cut]
                self.best_model_path, self.best_model_score = ordered[-1]

    # Lightning's two save paths (top-k, last.ckpt), each gated: Lightning keeps a NaN monitor as a score of inf, and
    # would make a NaN-loss state best.ckpt when nothing better was seen, and last.ckpt whatever it holds.
    def _save_topk_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        if holds_a_good_state(trainer):
            super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        if holds_a_good_state(trainer):
            super()._save_last_checkpoint(trainer, monitor_candidates)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self.monitor == "step" and trainer.should_stop and trainer.global_step >= trainer.max_steps:
            # The run's last step, off the checkpoint.every_n_steps grid (Lightning saves only on it): its step
            # checkpoint and last.ckpt all the same, so that last.ckpt is the model the run ends with.
            if self.format_checkpoint_name(self._monitor_candidates(trainer)) not in self.best_k_models:
                save_checkpoints_now(self, trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        for path in self.dropped:  # as the next save would prune them, had keep_last not been lowered
            trainer.strategy.remove_checkpoint(path)
        self.dropped = []


def holds_a_good_state(trainer: L.Trainer) -> bool:
    """A state worth resuming or sampling from: finite weights on every rank, and a finite loss at its last
    validation. Checked at each save (a collective): a diverged run's checkpoints would all look usable otherwise."""
    weights = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.lightning_module.parameters()]
    finite = bool(torch.stack([torch.isfinite(w).all() for w in weights]).all())
    loss = trainer.callback_metrics.get("val/loss")
    finite = finite and (loss is None or bool(torch.isfinite(loss)))
    return trainer.strategy.reduce_boolean_decision(finite, all=True)


class LinkingTrainer(L.Trainer):
    """A Trainer writing one payload per training state; other names saved in it become hard links. Not
    save_last="link": its symlink, to its own callback's file only, breaks when keep_last prunes that file."""

    written: tuple[tuple, str] | None = None  # the newest payload: its state and path

    def save_checkpoint(
        self, filepath: str | Path, weights_only: bool | None = None, storage_options: object = None
    ) -> None:
        # A preemption's checkpoint, saved after the loop closed the step and epoch, is another state.
        state = (self.global_step, bool(weights_only), self.fit_loop.epoch_progress.total.completed)
        source = self.written[1] if self.written is not None and self.written[0] == state else None
        if source is None:
            super().save_checkpoint(filepath, weights_only, storage_options)
            self.written = (state, str(filepath))
        elif Path(source).absolute() != Path(filepath).absolute():
            link = lambda: link_or_copy(Path(source), Path(filepath))  # noqa: E731
            if isinstance(self.strategy, AtomicModelParallelStrategy):  # the source may still be being written
                self.strategy.when_written(link, f"linking {filepath}")
            else:
                on_rank_zero(self.strategy, link, f"linking {filepath}")
