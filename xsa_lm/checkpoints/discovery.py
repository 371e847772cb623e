"""Finding the checkpoint to resume from: the newest complete one, skipping a truncated or corrupt one."""

import pickle
import zipfile
from pathlib import Path

import torch

from xsa_lm.checkpoints.sharded import META, shards_complete


def checkpoint_step(path: Path) -> int | None:
    """The checkpoint's global step, or None when it is truncated, incomplete or not a checkpoint."""
    if path.is_dir():  # sharded: complete when every shard is, the step in its meta.pt
        if not shards_complete(path):
            return None
        path = path / META
    try:
        with zipfile.ZipFile(path) as archive:  # torch.save files are zip archives with a CRC per member
            if archive.testzip() is not None:
                return None
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except (zipfile.BadZipFile, OSError, RuntimeError, EOFError, KeyError, ValueError, pickle.UnpicklingError):
        return None


def newest_valid_checkpoint(folder: Path) -> tuple[Path | None, int | None, list[Path]]:
    """The complete checkpoint with the highest step (last.ckpt wins ties), its step, and the corrupt ones skipped."""
    candidates = [folder / "last.ckpt", *sorted(folder.glob("step-*.ckpt")), folder / "last.ckpt.old"]
    steps = {path: checkpoint_step(path) for path in candidates if path.exists()}
    valid = [(path, step) for path, step in steps.items() if step is not None]
    best, best_step = max(valid, key=lambda found: found[1], default=(None, None))  # the first of equals
    return best, best_step, [path for path, step in steps.items() if step is None]


def furthest_step(folder: Path) -> int:
    """The highest step of the step-*.ckpt names and last.ckpt (a SIGTERM's falls between them); -1: none."""
    steps = [int(n) for p in folder.glob("step-*.ckpt") if (n := p.stem.removeprefix("step-")).isdigit()]
    last = checkpoint_step(folder / "last.ckpt")  # None: none there, or not whole
    return max(steps + ([last] if last is not None else []), default=-1)
