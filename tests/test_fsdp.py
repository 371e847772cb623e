"""FSDP2 (trainer=fsdp) on CPU with 2 gloo processes: the same training as one process, sharded checkpoints that
survive kill -9 and resume on another number of processes, and that analyze / eval read."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, cli_env, train_losses, wait_for, write_local_task
from tests.test_reliability import run_ok
from xsa_lm.checkpoints.discovery import newest_valid_checkpoint
from xsa_lm.checkpoints.load import load_model
from xsa_lm.files import read_csv

pytestmark = [pytest.mark.slow, pytest.mark.long]
STEPS = ["trainer.max_steps=20", "scheduler.total_steps=20", "val_every_steps=5", "checkpoint.keep_last=4"]
ARGS = [a for a in FAST if a != "trainer=cpu"] + ["attention=xsa", *STEPS]
FSDP = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


def metric(run_dir: Path, name: str) -> dict[int, float]:
    return {int(r["step"]): float(r[name]) for r in read_csv(run_dir / "metrics.csv")[1] if r.get(name)}


def assert_close(a: dict[int, float], b: dict[int, float], steps) -> None:
    assert sorted(a) == sorted(b) == list(steps)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step


def train_both(args: list[str], data_cache: Path, root: Path) -> str:
    """One process in root/single and FSDP2 on 2 processes in root/fsdp; the FSDP2 run's output."""
    run_ok(["train", *args, "trainer=cpu", f"hydra.run.dir={root / 'single'}"], data_cache, root)
    sharded = run_ok(["train", *args, *FSDP, f"hydra.run.dir={root / 'fsdp'}"], data_cache, root)
    return sharded.stdout + sharded.stderr


def assert_same_steps(root: Path, steps: range) -> None:
    for name in ("train/loss", "train/grad_norm"):
        assert_close(metric(root / "single", name), metric(root / "fsdp", name), steps)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    """20 steps in one process and under FSDP2 on 2 processes (sharded checkpoints, the default)."""
    root = tmp_path_factory.mktemp("fsdp")
    output = train_both(ARGS, data_cache, root)
    # no advice to sync_dist the validation metrics: they are sums reduced over the ranks before logging
    assert "x 1 accumulation x 2 device(s)" in output and "sync_dist" not in output
    return root


def test_fsdp2_trains_as_one_process(runs: Path):
    """Global batch 1024 tokens: one process accumulates 2 micro-batches, FSDP2 runs 1 on each of 2 ranks; the loss and
    the clipped norm are the global batch's, as the single process's at every step."""
    assert_same_steps(runs, range(20))
    single, fsdp = (
        json.loads((runs / name / "summary.json").read_text())["val_history"] for name in ("single", "fsdp")
    )
    for x, y in zip(single, fsdp, strict=True):
        assert x["step"] == y["step"] and y["val_loss"] == pytest.approx(x["val_loss"], rel=1e-5)


def test_fsdp2_with_accumulation_trains_sa_as_one_process(data_cache: Path, tmp_path: Path):
    """The SA baseline, global batch 2048 tokens: one process accumulates 4 micro-batches, FSDP2 2 on each of 2
    ranks, reducing the gradients once per step (after the last micro-batch): the same losses and global norms."""
    sa = [*[a for a in ARGS if a != "attention=xsa"], "attention=sa", "global_batch_tokens=2048"]
    args = [*sa, "trainer.max_steps=6", "scheduler.total_steps=6"]
    assert "x 2 accumulation x 2 device(s)" in train_both(args, data_cache, tmp_path)
    assert_same_steps(tmp_path, range(6))


def test_sharded_checkpoints_are_directories_that_analyze_and_eval_read(runs: Path, data_cache: Path, tmp_path: Path):
    folder = runs / "fsdp" / "checkpoints"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["best.ckpt", "last.ckpt", *[f"step-{s:06d}.ckpt" for s in (5, 10, 15, 20)]]  # no .tmp, .old
    assert sorted(p.name for p in (folder / "last.ckpt").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert newest_valid_checkpoint(folder)[:2] == (folder / "last.ckpt", 20)
    # Put back together in one process, the weights equal the single process's (float summation order aside).
    sharded, single = load_model(folder / "last.ckpt"), load_model(runs / "single" / "checkpoints" / "last.ckpt")
    for (name, a), b in zip(sharded.state_dict().items(), single.state_dict().values(), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name
    ckpts = f"ckpts=[{folder / 'last.ckpt'}]"
    run_ok(["analyze", ckpts, "sequences=2", f"hydra.run.dir={tmp_path / 'a'}"], data_cache, tmp_path)
    assert (tmp_path / "a" / "diagnostics.csv").read_text().count("\n") == 1 + 2  # a row per layer
    task = write_local_task(tmp_path / "tasks")
    run_ok(["eval", ckpts, f"tasks=[{task}]", "wandb=false", f"hydra.run.dir={tmp_path / 'e'}"], data_cache, tmp_path)
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["rows"][0]["attention"] == "xsa"


FSDP_ONE = [a for a in FSDP if a != "trainer.devices=2"] + ["trainer.devices=1"]


@pytest.mark.parametrize("where", [["trainer=cpu"], FSDP_ONE], ids=["trainer=cpu", "fsdp-1-process"])
def test_a_sharded_checkpoint_resumes_in_one_process(where: list[str], runs: Path, data_cache: Path, tmp_path: Path):
    """Written by 2 ranks at step 10, continued by one process: steps 10-19 as in the uninterrupted run."""
    ckpt = runs / "fsdp" / "checkpoints" / "step-000010.ckpt"
    run_dir = tmp_path / "run"
    out = run_ok(["train", *ARGS, *where, f"resume={ckpt}", f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    assert "x 2 accumulation x 1 device(s)" in out.stdout
    for name in ("train/grad_norm", "train/loss"):  # one process sees the whole batch, as the single run did
        single = metric(runs / "single", name)
        assert_close({s: single[s] for s in range(10, 20)}, metric(run_dir, name), range(10, 20))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 20


def test_kill_9_mid_run_then_resume_gives_identical_losses(runs: Path, data_cache: Path, tmp_path: Path):
    """kill -9 of both ranks once step 10's checkpoint is in place (a later one may be half written), then
    resume=auto on 2 processes, with activation checkpointing switched on (it recomputes the same values)."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "xsa_lm.cli", "train", *ARGS, *FSDP, f"hydra.run.dir={run_dir}"]
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    proc = subprocess.Popen(args, cwd=tmp_path, env=cli_env(data_cache), **quiet)
    wait_for(run_dir / "checkpoints" / "step-000010.ckpt", proc, timeout=300)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the rank it started: one process group
    proc.wait()
    assert not (run_dir / "summary.json").exists()
    resume = ["train", f"hydra.run.dir={run_dir}", "resume=auto", "trainer.activation_checkpointing=true"]
    again = run_ok(resume, data_cache, tmp_path)
    assert "resume: continuing the run" in again.stdout and "x 1 accumulation x 2 device(s)" in again.stdout
    assert_close(train_losses(runs / "fsdp"), train_losses(run_dir), range(20))
    assert_close(metric(runs / "fsdp", "train/grad_norm"), metric(run_dir, "train/grad_norm"), range(20))
    assert not list((run_dir / "checkpoints").glob("*.tmp")) and not list((run_dir / "checkpoints").glob("*.old"))


def test_a_nan_on_one_rank_is_skipped_on_every_rank(data_cache: Path, tmp_path: Path):
    """Only rank 1's loss is NaN at step 7: the global norm is NaN on both ranks, and both skip that update. The last
    step (12) is off the validation grid and validated all the same; consolidated checkpoints (one file)."""
    run_dir = tmp_path / "run"
    faults = "faults.inject_nan_at_step=7 faults.inject_nan_on_rank=1 faults.skip_nonfinite_batches=1".split()
    args = [*ARGS, *FSDP, "trainer.max_steps=12", *faults, "trainer.strategy.save_distributed_checkpoint=false"]
    run_ok(["train", *args, f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 12 and summary["val_history"][-1]["step"] == 12
    assert [e["step"] for e in summary["events"] if e["event"] == "skipped_batch"] == [7]
    losses = train_losses(run_dir)  # the mean over both ranks: NaN at step 7 only, whose update was skipped
    assert [step for step, loss in losses.items() if loss != loss] == [7] and len(losses) == 12
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 12 and all(torch.isfinite(t).all() for t in last["state_dict"].values())
