"""End-to-end: `xsa-lm train` on the bundled corpus, for both attention types, through the real CLI."""

import json
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import FAST, run_cli, train_losses
from xsa_lm.config import command_line
from xsa_lm.train.runinfo import code_version

pytestmark = pytest.mark.slow


def test_a_multirun_trains_both_attention_types_and_their_loss_falls(data_cache: Path, tmp_path: Path):
    """Both attention types in one --multirun; the progress bar counts optimizer steps (2 micro-batches per step:
    Lightning's own bar would read 80/40)."""
    sweep, fast = tmp_path / "multi", [a for a in FAST if a != "progress_bar=false"]
    out = run_cli(
        ["train", "--multirun", *fast, "attention=sa,xsa", "seed=1", f"hydra.sweep.dir={sweep}"], data_cache, tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"step\b.* 40/40 ", out.stdout) and "tokens/s" in out.stdout, out.stdout[-3000:]
    assert "80/40" not in out.stdout and "Epoch" not in out.stdout + out.stderr
    assert "litlogger" not in out.stderr and "LeafSpec" not in out.stderr  # noise with nothing for the user
    runs = {json.loads((p / "summary.json").read_text())["attention"]: p for p in sweep.glob("*/") if p.is_dir()}
    assert sorted(runs) == ["sa", "xsa"]
    for attention, run_dir in runs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["lr"] == 3e-3 and summary["seed"] == 1
        assert summary["steps"] == 40 and summary["tokens_seen"] == 40 * 1024
        assert summary["peak_lr"] == pytest.approx(3e-3) and summary["precision"] == "32-true"  # what it trained with
        train_tokens = int(re.search(r"([\d,]+) train / ", out.stdout).group(1).replace(",", ""))  # the header's
        assert summary["data_epochs"] == pytest.approx(40 * 1024 / train_tokens) and "epochs) |" in out.stdout
        assert summary["final_val_loss"] == summary["val_history"][-1]["val_loss"]
        assert [h["step"] for h in summary["val_history"]] == [20, 40]
        assert summary["final_val_loss"] < summary["val_history"][0]["val_loss"] < 6.2  # log(512) = 6.24
        # 8 equal spans of the 64 positions, every window full: their mean is the loss; bits per byte beside nats
        spans = summary["final_val_loss_by_position"]
        assert len(spans) == 8 and sum(spans) / 8 == pytest.approx(summary["final_val_loss"], rel=1e-6)
        assert 0 < summary["final_val_bpb"] == summary["val_history"][-1]["val_bpb"]
        losses = train_losses(run_dir)
        first, last = [losses[s] for s in sorted(losses)[:5]], [losses[s] for s in sorted(losses)[-5:]]
        assert len(losses) == 40 and sum(last) / 5 < sum(first) / 5 - 0.5
        header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
        train_keys = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_seen", "train/tokens_per_s"}
        assert train_keys | {"val/loss", "val/ppl", "val/bpb"} <= set(header)
        info = json.loads((run_dir / "run_info.json").read_text())
        assert info["versions"]["torch"] and info["versions"]["lightning"] and info["hardware"]["cpu_count"]
        assert summary["code"] == code_version().to_json()  # what a study compares before reusing the run
        assert summary["cpu_threads"] >= 1  # on CPU another thread count sums in another order
        assert info["git"] == {"commit": summary["code"]["commit"], "dirty": summary["code"]["dirty"]}
        assert info["code"] == summary["code"]  # what a study compares before resuming the run
        assert info["command"][1] == "train" and info["command"][-1] == f"hydra.sweep.dir={sweep}"  # as typed
        config = (run_dir / "config.yaml").read_text()
        assert f"name: {attention}" in config and "lr: 0.003" in config
        assert (run_dir / "checkpoints" / "last.ckpt").exists() and (run_dir / "checkpoints" / "best.ckpt").exists()
        log = (run_dir / "train.log").read_text()  # the run's own lines, with times
        assert "xsa-lm train |" in log and "non-embedding parameters" in log and f"COMPLETED: {attention}" in log
        assert "final val loss" in log


@pytest.mark.long
def test_cfg_job_help_and_module_entry_point(data_cache: Path, tmp_path: Path):
    out = run_cli(["train", "attention=xsa", "model=gpt2_124m", "--cfg", "job"], data_cache, tmp_path)
    assert out.returncode == 0 and "name: xsa" in out.stdout and "n_layer: 12" in out.stdout
    help_ = run_cli(["train", "--help"], data_cache, tmp_path)
    assert help_.returncode == 0 and "attention: sa, xsa" in help_.stdout
    top = run_cli(["--help"], data_cache, tmp_path)
    assert top.returncode == 0 and "train" in top.stdout
    # `python -m xsa_lm.train` is the same entry point as `xsa-lm train`
    args = ["attention=xsa", "--cfg", "job"]
    module = run_cli(args, data_cache, tmp_path, module="xsa_lm.train")
    assert module.returncode == 0 and module.stdout == run_cli(["train", *args], data_cache, tmp_path).stdout
    assert not (tmp_path / "outputs").exists()  # printing the config or the help writes no run folder


@pytest.mark.long
def test_ddp_on_cpu_with_two_processes(data_cache: Path, tmp_path: Path):
    """`xsa-lm train trainer.devices=2` relaunches the command for rank 1 (gloo); one W&B run, one summary."""
    run_dir = tmp_path / "ddp"
    args = [*FAST, "logger=wandb", "trainer.max_steps=10", "val_every_steps=5", "trainer.devices=2"]
    args += ["trainer.strategy=ddp", f"hydra.run.dir={run_dir}"]
    out = run_cli(["train", *args], data_cache, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 10
    assert summary["tokens_seen"] == 10 * 1024  # global batch fixed: 8 sequences x 64 tokens x 2 ranks
    assert "x 1 accumulation x 2 device(s)" in out.stdout
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert not list(run_dir.glob("config.resume-*.yaml"))


@pytest.mark.long
def test_a_labs_own_experiment_outside_the_repository(data_cache: Path, tmp_path: Path):
    """`--config-dir` (or hydra.searchpath) adds a folder of the user's own config files to Hydra's search path."""
    lab = tmp_path / "lab"
    (lab / "experiment").mkdir(parents=True)
    (lab / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: tiny_d32\n\n"
        "seed: 7\nval_every_steps: 3\ntrainer:\n  max_steps: 3\n"
    )
    quick = ["trainer=cpu", "logger=csv", "progress_bar=false", "global_batch_tokens=1024", "micro_batch_size=8"]
    run_dir = tmp_path / "run"
    args = [
        "train",
        "--config-dir",
        str(lab),
        "experiment=mine",
        *quick,
        "data.val_windows=8",
        f"hydra.run.dir={run_dir}",
    ]
    out = run_cli(args, data_cache, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    saved = (run_dir / "config.yaml").read_text()
    assert "name: tiny_d32" in saved and "max_steps: 3" in saved and "seed: 7" in saved
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    searched = run_cli(
        ["train", f"hydra.searchpath=[file://{lab}]", "experiment=mine", "--cfg", "job"], data_cache, tmp_path
    )
    assert searched.returncode == 0 and "name: tiny_d32" in searched.stdout and "seed: 7" in searched.stdout
    missing = run_cli(["train", "experiment=mine"], data_cache, tmp_path)  # not on the search path: one line
    assert missing.returncode == 2 and missing.stderr.strip().startswith("xsa-lm: error: In 'train': Could not find")


def test_a_child_process_tells_what_was_set_for_it_from_what_was_set_for_its_parent(monkeypatch: pytest.MonkeyPatch):
    """`xsa-lm train` shortens sys.argv for Hydra and asks Hydra to raise; a child (a DDP rank, a trial) inherits
    both settings, and tells the whole command line and the user's HYDRA_FULL_ERROR from its parent's."""
    from xsa_lm.errors import OURS_VARIABLE, full_errors

    monkeypatch.setenv(command_line.ARGV_VARIABLE, json.dumps(["xsa-lm", "train", "seed=1"]))
    monkeypatch.setattr(sys, "argv", ["xsa-lm", "seed=1"])
    assert command_line.full_command_line() == ["xsa-lm", "train", "seed=1"]
    monkeypatch.setattr(sys, "argv", ["xsa_lm/train/__main__.py", "seed=2"])  # a child that inherited the variable
    assert command_line.full_command_line() == ["xsa_lm/train/__main__.py", "seed=2"]
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.delenv(OURS_VARIABLE, raising=False)
    assert full_errors()  # the user's
    monkeypatch.setenv(OURS_VARIABLE, "1")  # inherited from `xsa-lm`, which set both for itself
    assert not full_errors()
