"""End to end: with no W&B API key a training run logs offline, and its .wandb file holds the metrics and the config."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST, cli_env
from tests.wandb_records import config, history

LR = 2e-3
MAX_STEPS = 6


@pytest.mark.slow
def test_offline_run_file_holds_history_and_config(tmp_path: Path, data_cache: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [*FAST, "logger=wandb", f"optim.lr={LR}", f"trainer.max_steps={MAX_STEPS}", "val_every_steps=3"]
    # No WANDB_MODE, no API key, no ~/.netrc: the logger's "auto" mode has to choose offline by itself.
    env = cli_env(data_cache, home=tmp_path)
    del env["WANDB_MODE"]
    proc = subprocess.run(
        [sys.executable, "-m", "xsa_lm.train", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "wandb sync" in proc.stdout

    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1, offline_runs
    (run_file,) = offline_runs[0].glob("run-*.wandb")

    rows = history(run_file)
    train = [row for row in rows if "train/loss" in row]
    losses = [row["train/loss"] for row in train]
    assert len(losses) == MAX_STEPS, rows  # trainer.log_every_n_steps=1
    assert all(isinstance(x, float) and math.isfinite(x) for x in losses), losses
    assert all(x < losses[0] for x in losses[MAX_STEPS // 2 :]), losses
    steps = [row["trainer/global_step"] for row in train]
    assert steps == sorted(set(steps)), steps

    # The validations in the .wandb file are the ones the run itself reports in summary.json.
    val_losses = [row["val/loss"] for row in rows if "val/loss" in row]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(val_losses) == 2
    assert val_losses == pytest.approx([v["val_loss"] for v in summary["val_history"]])

    cfg = config(run_file)
    assert cfg["attention"]["name"] == "sa"
    assert cfg["model"]["name"] == "tiny"
    assert cfg["optim"]["lr"] == LR
    assert cfg["trainer"]["max_steps"] == MAX_STEPS
    assert cfg["data"]["cache_dir"] == str(data_cache)
