"""Which device this process trains on, set before anything touches CUDA: Lightning sets it only once the Trainer
starts, so every rank would first open a context on GPU 0 (about 0.5 GiB each) and measure GPU 0's free memory."""

import os
from collections.abc import Sequence

import torch

LOADER_WORKERS_PER_RANK = 4  # enough to keep a GPU fed from memory-mapped token shards


def uses_cuda(accelerator: str) -> bool:
    """Whether a run with this trainer.accelerator trains on CUDA devices."""
    return accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def set_device(*, accelerator: str, devices: int | str | Sequence[int]) -> None:
    """Make this rank's GPU current: the rank-th (LOCAL_RANK, SLURM_LOCALID) of trainer.devices' list, or of all;
    one that is not visible (one GPU per task under srun) is left to Lightning's device check."""
    if not uses_cuda(accelerator):
        return
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    index = int(devices[rank]) if isinstance(devices, Sequence) and not isinstance(devices, str) else rank
    if index < torch.cuda.device_count():
        torch.cuda.set_device(index)


def loader_workers(num_workers: int | str, *, accelerator: str, ranks_per_node: int) -> int:
    """data.num_workers; auto: none on CPU, on GPU 1 to LOADER_WORKERS_PER_RANK within the ranks' share of CPUs."""
    if num_workers != "auto":
        return int(num_workers)
    if not uses_cuda(accelerator):
        return 0
    return max(1, min(LOADER_WORKERS_PER_RANK, usable_cpus() // max(ranks_per_node, 1)))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a SLURM or container share), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compile_enabled(compile: bool | str, *, accelerator: str) -> bool:
    """compile=auto: on for CUDA runs, off on CPU (there the first compile takes longer than a short run saves)."""
    return uses_cuda(accelerator) if compile == "auto" else bool(compile)
