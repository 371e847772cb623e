"""Checkpoints written once per event (best.ckpt and last.ckpt linked to it), a save interval of its own, and the
refusals that keep a cluster run from training wrong or hanging: world size, unshared checkpoint directories, rank 0
failing its part of a checkpoint. Multi-process behaviour: 2 gloo processes on CPU."""

import datetime
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port as free_port

from tests.helpers import FAST, train_from, train_losses
from tests.helpers import compose_train as composed
from tests.test_reliability import run_ok
from tests.test_sharded_checkpoints import write_sharded
from xsa_lm.checkpoints.atomic import link_or_copy, on_rank_zero
from xsa_lm.checkpoints.discovery import checkpoint_step
from xsa_lm.checkpoints.load import load_model
from xsa_lm.errors import UserError
from xsa_lm.train.cluster import ClusterChecks, check_shared_directory, check_slurm_tasks, check_world_size


def train_here(data_cache: Path, monkeypatch, run_dir: Path, overrides: list[str]) -> None:
    """A run in this process, its warnings hidden."""
    monkeypatch.setenv("XSA_LM_DATA_DIR", str(data_cache))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_from(composed(overrides), run_dir)


def train_counting_payloads(tmp_path: Path, data_cache: Path, monkeypatch, *overrides: str) -> list[str]:
    """A run in this process; the name of every checkpoint payload torch.save wrote, in order."""
    settings = [*FAST, "trainer.max_steps=20", "scheduler.total_steps=20", *overrides]
    with mock.patch.object(torch, "save", wraps=torch.save) as save:
        train_here(data_cache, monkeypatch, tmp_path / "run", settings)
    names = [str(getattr(call.args[1], "name", call.args[1])) for call in save.call_args_list]
    return [Path(n).name.removesuffix(".tmp") for n in names if n.endswith(".tmp") or "/step-" in n or ".ckpt" in n]


@pytest.mark.slow
@pytest.mark.long
def test_each_validation_writes_one_checkpoint_and_links_last_and_best(tmp_path, data_cache, monkeypatch):
    written = train_counting_payloads(tmp_path, data_cache, monkeypatch, "val_every_steps=10", "checkpoint.keep_last=1")
    # Two validations, one payload each: best.ckpt's where the loss improved (the others link to it), else last.ckpt's.
    assert len(written) == 2 and set(written) <= {"best.ckpt", "last.ckpt"}, written
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["best.ckpt", "last.ckpt", "step-000020.ckpt"]
    step = (folder / "step-000020.ckpt").stat()
    assert (folder / "last.ckpt").stat().st_ino == step.st_ino and step.st_nlink >= 2  # a hard link, no copy
    best_step = checkpoint_step(folder / "best.ckpt")
    assert best_step in (10, 20) and checkpoint_step(folder / "last.ckpt") == 20  # best outlives step-10's pruning
    load_model(folder / "best.ckpt")  # what analyze / eval / generate read


@pytest.mark.slow
def test_a_run_resumed_from_an_every_n_steps_checkpoint_logs_the_steps_it_trains(tmp_path, data_cache, monkeypatch):
    """Lightning saves such a checkpoint before it counts the step its loggers write: resumed from step 3, the run's
    metrics.csv labelled steps 3, 4, 5 as 2, 3, 4 (with the right losses)."""
    settings = [*FAST, "trainer.max_steps=6", "scheduler.total_steps=6", "val_every_steps=1000"]
    settings += ["checkpoint.every_n_steps=3", "checkpoint.keep_last=4"]
    train_here(data_cache, monkeypatch, tmp_path / "a", settings)
    checkpoint = tmp_path / "a" / "checkpoints" / "step-000003.ckpt"
    train_here(data_cache, monkeypatch, tmp_path / "b", [*settings, f"resume={checkpoint}"])
    first, resumed = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert sorted(resumed) == [3, 4, 5]
    assert resumed == pytest.approx({step: first[step] for step in (3, 4, 5)}, rel=1e-6)


def test_a_link_outlives_its_source_and_falls_back_on_a_copy(tmp_path: Path, monkeypatch):
    folder = tmp_path / "checkpoints"
    write_sharded(folder / "step-000010.ckpt", step=10)
    link_or_copy(folder / "step-000010.ckpt", folder / "best.ckpt")
    distcp = next((folder / "best.ckpt").glob("*.distcp"))
    assert distcp.stat().st_ino == (folder / "step-000010.ckpt" / distcp.name).stat().st_ino
    for item in (folder / "step-000010.ckpt").iterdir():  # pruned by keep_last
        item.unlink()
    (folder / "step-000010.ckpt").rmdir()
    assert checkpoint_step(folder / "best.ckpt") == 10 and sorted(p.name for p in folder.iterdir()) == ["best.ckpt"]

    def no_links(source, target):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.warns(UserWarning, match="cannot hard-link .* copying it"):
        link_or_copy(folder / "best.ckpt", folder / "last.ckpt")
    assert checkpoint_step(folder / "last.ckpt") == 10 and not list(folder.glob("*.tmp"))


def test_a_world_size_other_than_planned_is_refused():
    with pytest.raises(UserError, match=r"^1 process\(es\) joined this run but .* plans 8 .* srun"):
        check_world_size(planned=8, joined=1)
    checks = ClusterChecks(planned_world_size=8, checkpoint_dir=Path("unused"))
    with pytest.raises(UserError, match="plans 8"):  # at fit start, on every rank (a faked trainer: sbatch, no srun)
        checks.setup(SimpleNamespace(world_size=1), None, "fit")
    check_world_size(planned=2, joined=2)


SRUN = {"SLURM_JOB_NAME": "python", "SLURM_NTASKS": "2"}  # a 2-task srun step (a job named bash: interactive)
SLURM_TASKS = {  # (variables, trainer.devices, trainer.num_nodes) -> the refusal's start, None: accepted
    "--ntasks=2 alone": (SRUN, 2, 1, "srun started 2 tasks without --ntasks-per-node, which Lightning needs"),
    "--ntasks=4 alone, 2 nodes": (SRUN | {"SLURM_NTASKS": "4"}, 2, 2, "srun started 4 tasks without"),
    "--ntasks-per-node=2, devices=1": (SRUN | {"SLURM_NTASKS_PER_NODE": "2"}, 1, 1, "srun --ntasks-per-node=2 starts"),
    "--ntasks-per-node=2, devices=2": (SRUN | {"SLURM_NTASKS_PER_NODE": "2"}, 2, 1, None),
    "one task": (SRUN | {"SLURM_NTASKS": "1"}, 1, 1, None),
    "an interactive shell": (SRUN | {"SLURM_JOB_NAME": "bash"}, 1, 1, None),
    "no SLURM": ({}, 1, 1, None),
}


@pytest.mark.parametrize(("variables", "devices", "nodes", "refused"), SLURM_TASKS.values(), ids=SLURM_TASKS.keys())
def test_srun_tasks_other_than_one_per_device_are_refused_in_srun_terms(
    variables: dict[str, str], devices: int, nodes: int, refused: str | None, monkeypatch
):
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if refused is None:
        check_slurm_tasks(devices=devices, num_nodes=nodes)
        return
    with pytest.raises(UserError, match=f"^{re.escape(refused)}") as error:
        check_slurm_tasks(devices=devices, num_nodes=nodes)
    assert f"srun --nodes={nodes} --ntasks-per-node={devices}" in str(error.value)  # the launch that fits


class GlooRanks:
    """What a Lightning strategy offers the checks (broadcast, barrier, all_gather), over a plain gloo group."""

    root_device = torch.device("cpu")

    @property
    def is_global_zero(self) -> bool:
        return dist.get_rank() == 0

    def broadcast(self, obj: object, src: int = 0) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self, name: str | None = None) -> None:
        dist.barrier()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(out, tensor)
        return torch.stack(out)


def outcome(action) -> str:
    try:
        action()
        return "no error"
    except UserError as e:  # CheckpointWriteError included
        return str(e)


def _rank(rank: int, port: int, folder: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    ranks = GlooRanks()

    def rename_fails() -> None:
        raise PermissionError(13, "Permission denied", f"{folder}/last.ckpt")

    start = time.monotonic()
    failed = outcome(lambda: on_rank_zero(ranks, rename_fails, "putting checkpoint last.ckpt in place"))
    results[f"{rank}-finalise"] = f"{time.monotonic() - start:.1f} s: {failed}"
    trainer = SimpleNamespace(strategy=ranks, is_global_zero=rank == 0, world_size=2)
    # a node-local checkpoints/: each rank looks in a directory of its own
    results[f"{rank}-shared"] = outcome(lambda: check_shared_directory(trainer, Path(folder) / f"node{rank}"))
    results[f"{rank}-shared-ok"] = outcome(lambda: check_shared_directory(trainer, Path(folder) / "shared"))
    dist.destroy_process_group()


def test_two_ranks_fail_together_on_rank_zero_errors_and_unshared_directories(tmp_path: Path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(free_port(), str(tmp_path), results), nprocs=2, start_method="fork")
        results = dict(results)
    for rank in (0, 1):  # at once (a broadcast), not at a barrier's 60 s timeout; with rank 0's error
        seconds, message = results[f"{rank}-finalise"].split(" s: ")
        assert float(seconds) < 10 and "PermissionError" in message and "rank 0" in message, results
        assert "is not shared: rank(s) [1] cannot see" in results[f"{rank}-shared"], results
        assert results[f"{rank}-shared-ok"] == "no error"
    assert not list((tmp_path / "shared").iterdir())  # the token is removed


@pytest.mark.slow
@pytest.mark.long
def test_an_async_saved_sharded_checkpoint_resumes(data_cache: Path, tmp_path: Path):
    """FSDP2 on 2 gloo processes with checkpoint.async_save: the checkpoints are in place, whole and linked by the
    end of the fit, and step 5's continues with the losses of the uninterrupted run."""
    from tests.test_fsdp import ARGS, FSDP, assert_close, metric

    common = ["train", *ARGS, *FSDP, "trainer.max_steps=10", "scheduler.total_steps=20", "checkpoint.async_save=true"]
    run_ok([*common, f"hydra.run.dir={tmp_path / 'async'}"], data_cache, tmp_path)
    folder = tmp_path / "async" / "checkpoints"
    expected = ["best.ckpt", "last.ckpt", "step-000005.ckpt", "step-000010.ckpt"]
    assert sorted(p.name for p in folder.iterdir()) == expected
    assert checkpoint_step(folder / "last.ckpt") == 10 and checkpoint_step(folder / "step-000005.ckpt") == 5
    resume = f"resume={folder / 'step-000005.ckpt'}"
    run_ok([*common, resume, f"hydra.run.dir={tmp_path / 'r'}"], data_cache, tmp_path)
    fsdp = metric(tmp_path / "async", "train/loss")
    assert_close({s: fsdp[s] for s in range(5, 10)}, metric(tmp_path / "r", "train/loss"), range(5, 10))


@pytest.mark.slow
def test_a_resume_with_a_lower_keep_last_prunes_the_older_step_checkpoints(tmp_path, data_cache, monkeypatch):
    """keep_last lowered on a resume: the step checkpoints past it go as training starts, as a later save would
    have pruned them; none is left behind, unmanaged, for resume=auto to fall back on."""
    settings = [*FAST, "val_every_steps=2", "scheduler.total_steps=8"]
    folder = tmp_path / "run" / "checkpoints"
    train_here(data_cache, monkeypatch, tmp_path / "run", [*settings, "trainer.max_steps=6", "checkpoint.keep_last=3"])
    assert sorted(p.name for p in folder.glob("step-*")) == [f"step-00000{s}.ckpt" for s in (2, 4, 6)]
    settings.append("resume=auto")
    train_here(data_cache, monkeypatch, tmp_path / "run", [*settings, "trainer.max_steps=8", "checkpoint.keep_last=1"])
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-000008.ckpt"]
    train_here(data_cache, monkeypatch, tmp_path / "run", [*settings, "trainer.max_steps=10", "checkpoint.keep_last=0"])
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-000008.ckpt"]  # the file resumed from stays
    assert checkpoint_step(folder / "last.ckpt") == 10


@pytest.mark.slow
def test_a_run_folder_copied_elsewhere_resumes_with_its_kept_checkpoints(tmp_path, data_cache, monkeypatch):
    """Lightning forgets the checkpoints it kept when the folder's path changed: keep_last would never prune the
    copied ones, and the next validation would replace best.ckpt, better or not."""
    settings = [*FAST, "val_every_steps=2", "checkpoint.keep_last=2", "scheduler.total_steps=8"]
    train_here(data_cache, monkeypatch, tmp_path / "a", [*settings, "trainer.max_steps=4"])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    train_here(data_cache, monkeypatch, tmp_path / "b", [*settings, "trainer.max_steps=8", "resume=auto"])
    folder = tmp_path / "b" / "checkpoints"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-000006.ckpt", "step-000008.ckpt"]
    history = json.loads((tmp_path / "b" / "summary.json").read_text())["val_history"]
    best = min(history, key=lambda row: row["val_loss"])["step"]
    assert checkpoint_step(folder / "best.ckpt") == best, history


@pytest.mark.slow
@pytest.mark.long
def test_checkpoint_every_n_steps_is_apart_from_validation_and_the_last_step_is_checkpointed(
    tmp_path, data_cache, monkeypatch
):
    """Step checkpoints on their own grid (validations at 7 and 14 have none to link to); the last step (20) is off
    it and checkpointed all the same, last.ckpt included."""
    settings = ["val_every_steps=7", "checkpoint.every_n_steps=3", "checkpoint.keep_last=10"]
    written = train_counting_payloads(tmp_path, data_cache, monkeypatch, *settings)
    steps = [f"step-{s:06d}.ckpt" for s in (3, 6, 9, 12, 15, 18)]
    assert [w for w in written if w.startswith("step-")] == steps
    assert set(written) - set(steps) <= {"best.ckpt", "last.ckpt"} and len(written) <= len(steps) + 3, written
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.glob("step-*")) == [*steps, "step-000020.ckpt"]
    assert checkpoint_step(folder / "last.ckpt") == checkpoint_step(folder / "step-000020.ckpt") == 20
    last = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=False)
    (history,) = [state["history"] for key, state in last["callbacks"].items() if "ValHistory" in key]
    assert [h["step"] for h in history] == [7, 14, 20]  # the last step's validation in it
