"""Checks every rank makes once the processes have joined, each refusal one line (no hang): as many processes as the
accumulation was sized for, a checkpoint directory every rank sees, and the checkpoint rank 0 chose to resume from."""

import os
import secrets
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from xsa_lm.checkpoints.atomic import on_rank_zero
from xsa_lm.compat import agree_on_resume_checkpoint
from xsa_lm.errors import UserError

TOKEN = ".rank0-token-"  # a file rank 0 writes into the checkpoint directory, gone once every rank has looked


def check_world_size(*, planned: int, joined: int) -> None:
    if joined != planned:
        raise UserError(
            f"{joined} process(es) joined this run but trainer.devices x trainer.num_nodes plans {planned} (the "
            "gradient accumulation is sized for them): under SLURM start one task per device with srun "
            "(sbatch alone starts one), or set trainer.devices and trainer.num_nodes to what is launched"
        )


def check_slurm_tasks(*, devices: int, num_nodes: int) -> None:
    """Under srun, one task per device on each node (Lightning's SLURM placement), checked before Lightning, whose own
    refusal names the accelerator. A mismatch said in srun's terms."""
    if not SLURMEnvironment.detect():  # no srun step, or an interactive shell (Lightning ignores SLURM there)
        return
    tasks, per_node = int(os.environ["SLURM_NTASKS"]), os.environ.get("SLURM_NTASKS_PER_NODE")
    launch = f"srun --nodes={num_nodes} --ntasks-per-node={devices}"
    plan = f"trainer.devices={devices} x trainer.num_nodes={num_nodes}"
    if per_node is None and tasks > 1:
        raise UserError(
            f"srun started {tasks} tasks without --ntasks-per-node, which Lightning needs to place one task per "
            f"device: launch with `{launch}` for {plan}, or set trainer.devices and trainer.num_nodes to the tasks"
        )
    if per_node is not None and int(per_node) != devices:
        raise UserError(
            f"srun --ntasks-per-node={per_node} starts that many tasks on each node, but {plan} plans {devices} per "
            f"node: launch with `{launch}`, or set trainer.devices={per_node}"
        )


class ClusterChecks(L.Callback):
    def __init__(self, *, planned_world_size: int, checkpoint_dir: Path) -> None:
        self.planned_world_size = planned_world_size
        self.checkpoint_dir = checkpoint_dir

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_world_size(planned=self.planned_world_size, joined=trainer.world_size)
        if trainer.world_size > 1:
            check_shared_directory(trainer, self.checkpoint_dir)
            agree_on_resume_checkpoint(trainer, trainer.strategy.broadcast)  # rank 0's choice, on every rank


def check_shared_directory(trainer: L.Trainer, folder: Path) -> None:
    """Rank 0 writes a token file into `folder`; every rank looks for it; the ranks that did not see it are named."""
    token = trainer.strategy.broadcast(secrets.token_hex(8))
    path = folder / f"{TOKEN}{token}"

    def write() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text("written by rank 0; every rank of the run must see this file\n")

    on_rank_zero(trainer.strategy, write, f"writing into the checkpoint directory {folder}")  # fails on every rank
    trainer.strategy.barrier("token written")
    seen = torch.tensor([float(path.is_file())], device=trainer.strategy.root_device)
    everyone = trainer.strategy.all_gather(seen).flatten().tolist()
    trainer.strategy.barrier("token seen")
    if trainer.is_global_zero:
        path.unlink()
    blind = [rank for rank, saw in enumerate(everyone) if not saw]
    if blind:
        raise UserError(
            f"the checkpoint directory {folder} is not shared: rank(s) {blind} cannot see what rank 0 writes there "
            "(a node-local disk?); put hydra.run.dir on a filesystem every node mounts"
        )
