"""A run cannot silently go wrong: a resume continues the run as saved, one run per directory, Ctrl-C checkpoints."""

import csv
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import FAST, assert_clean_error, cli_in_process, refused_in_process, run_cli, train_losses, wait_for
from tests.helpers import start_cli as start
from tests.test_reliability import stop_mid_run
from xsa_lm.checkpoints.atomic import FolderCheckpoint
from xsa_lm.config.resume import continuation_config
from xsa_lm.errors import UserError
from xsa_lm.locking import hold_directory
from xsa_lm.train.schedule import warmup_cosine

XSA = ["train", *FAST, "attention=xsa", "val_every_steps=10"]


def snapshot(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def xsa_run(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    """An XSA run of 20 steps (of a 20-step schedule) that the tests below resume or try to change."""
    root = tmp_path_factory.mktemp("xsa")
    out = run_cli([*XSA, "trainer.max_steps=20", f"hydra.run.dir={root / 'run'}"], data_cache, root)
    assert out.returncode == 0, out.stderr[-2000:]
    return root / "run"


@pytest.mark.slow
@pytest.mark.long  # make test resumes exactly after kill -9 and SIGTERM (test_reliability.py)
def test_the_readme_resume_line_continues_xsa_exactly(xsa_run: Path, data_cache: Path, tmp_path: Path):
    """`xsa-lm train hydra.run.dir=runs/xsa resume=auto trainer.max_steps=N`, nothing else on the command line:
    the saved config decides (XSA, its LR, batch, vocabulary), the schedule keeps its saved length and the data
    continues where the checkpoint's sampler stopped: the same losses as one straight run."""
    run_dir = tmp_path / "run"
    subprocess.run(["cp", "-r", str(xsa_run), str(run_dir)], check=True)
    sampler = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["TokenDataModule"]
    assert sampler["global_micro_batches"] == 40 and sampler["seed"] == 0  # 20 steps x 2 accumulated micro-batches
    data_dir = Path(json.loads((run_dir / "run_info.json").read_text())["data_dir"])  # and the tokenizer's identity
    assert sampler["tokenizer_sha256"] == json.loads((data_dir / "meta.json").read_text())["tokenizer"]["sha256"]
    out = run_cli(["train", f"hydra.run.dir={run_dir}", "resume=auto", "trainer.max_steps=40"], data_cache, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    assert first.startswith("resume: continuing") and "(xsa, tiny, lr 0.003, seed 0) from step 20" in first
    assert "trainer.max_steps: 20 -> 40" in first and "keeps its saved length (scheduler.total_steps=20)" in first
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["attention"] == "xsa" and summary["lr"] == 3e-3 and summary["steps"] == 40
    assert summary["tokens_seen"] == 40 * 1024 and "COMPLETED: xsa" in out.stdout
    # The uninterrupted run of the same plan: 40 steps on a 20-step schedule.
    straight = run_cli(
        [*XSA, "trainer.max_steps=40", "scheduler.total_steps=20", f"hydra.run.dir={tmp_path / 's'}"],
        data_cache,
        tmp_path,
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert train_losses(run_dir) == train_losses(tmp_path / "s")  # bit-identical on CPU, fp32
    config = OmegaConf.load(run_dir / "config.yaml")
    assert config.attention.name == "xsa" and config.trainer.max_steps == 40 and config.scheduler.total_steps == 20
    record = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["from_step"] == 20 and "trainer.max_steps: 20 -> 40" in record["changes"]
    assert len(list((run_dir / "wandb").glob("*"))) == 0  # the saved logger (csv) is kept, not the default W&B
    assert "resume: continuing" in (run_dir / "train.log").read_text()


@pytest.mark.slow
def test_a_resume_that_changes_the_validation_and_the_schedule_logs_each_step_once_at_its_lr(
    xsa_run: Path, data_cache: Path, tmp_path: Path
):
    """Another val_every_steps on the command line numbered every row after the resume one step low (step 19
    twice); a schedule recomputed (here by a config.yaml edited by hand, which the resume line named as saved) ran
    its first step at the old schedule's LR."""
    run_dir = tmp_path / "run"
    shutil.copytree(xsa_run, run_dir)
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("  total_steps: 20\n", "  total_steps: 30\n", 1))
    args = ["train", f"hydra.run.dir={run_dir}", "resume=auto", "trainer.max_steps=26", "val_every_steps=4"]
    out = run_cli(args, data_cache, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    edited = "scheduler.total_steps: 20 -> 30 (config.yaml edited since the checkpoint)"
    assert edited in first and first.endswith("LR schedule recomputed for scheduler.total_steps=30 (was 20)")
    record = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])
    assert edited in record["changes"] and "val_every_steps: 10 -> 4" in record["changes"]
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert [int(r["step"]) for r in rows] == list(range(26))
    assert [float(r["train/tokens_seen"]) for r in rows] == [1024.0 * (step + 1) for step in range(26)]
    peak, min_ratio = 3e-3, OmegaConf.load(config).scheduler.min_lr_ratio
    for r in rows[20:]:
        expected = peak * warmup_cosine(int(r["step"]), warmup_steps=5, total_steps=30, min_lr_ratio=min_ratio)
        assert float(r["train/lr"]) == pytest.approx(expected, rel=1e-6), r["step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [h["step"] for h in summary["val_history"]] == [10, 20, 24, 26]
    # keep_last=2, although step 20's checkpoint was saved before its own callback counted it
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000024.ckpt", "step-000026.ckpt"]


@pytest.mark.slow
def test_a_checkpoint_holds_the_best_loss_its_run_reached(xsa_run: Path):
    """The step checkpoint's payload was saved before the val/loss callback took that validation in: a resume
    compared the next losses against the one before, and could replace best.ckpt with a worse model."""
    summary = json.loads((xsa_run / "summary.json").read_text())
    losses = [h["val_loss"] for h in summary["val_history"]]
    assert losses[-1] < losses[0]  # step 20 improved on step 10
    saved = torch.load(xsa_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    best = next(v for k, v in saved["callbacks"].items() if "val/loss" in k)
    assert float(best["best_model_score"]) == pytest.approx(min(losses))


@pytest.mark.slow
def test_a_new_run_validated_on_other_windows_starts_its_history_afresh(xsa_run: Path, data_cache: Path, tmp_path):
    """A new run from a checkpoint with another data.val_windows mixed the checkpoint's losses (another validation
    set) into its val_history and best_val_loss. Its only validation is at its last step (25), off the val_every_steps
    grid: the checkpoints of that step must hold that validation."""
    new_dir = tmp_path / "new"
    args = [*XSA, "data.val_windows=32", "trainer.max_steps=25", f"resume={xsa_run / 'checkpoints' / 'last.ckpt'}"]
    out = run_cli([*args, f"hydra.run.dir={new_dir}"], data_cache, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "validation history (2 points) was measured on another validation set" in out.stdout
    assert "dirpath has changed" not in out.stdout + out.stderr  # Lightning's: the resume line says where it starts
    summary = json.loads((new_dir / "summary.json").read_text())
    assert [h["step"] for h in summary["val_history"]] == [25]
    assert summary["best_val_loss"] == summary["final_val_loss"]
    saved = torch.load(new_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert [h["step"] for h in saved["callbacks"]["ValHistory"]["history"]] == [25]


@pytest.mark.slow
def test_a_new_run_at_another_batch_size_counts_the_tokens_of_each_step(xsa_run: Path, data_cache: Path, tmp_path):
    """Tokens seen were counted as steps x this run's tokens per step, so a new run from a checkpoint at another
    global_batch_tokens counted the checkpoint's 20 steps at its own batch size too."""
    new_dir = tmp_path / "new"
    resume = f"resume={xsa_run / 'checkpoints' / 'last.ckpt'}"
    args = [*XSA, "global_batch_tokens=2048", "trainer.max_steps=24", resume, f"hydra.run.dir={new_dir}"]
    out = run_cli(args, data_cache, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((new_dir / "summary.json").read_text())
    seen = 20 * 1024 + 4 * 2048
    assert summary["tokens_seen"] == seen and [h["tokens"] for h in summary["val_history"]] == [10240, 20480, seen]
    first = json.loads((xsa_run / "summary.json").read_text())
    assert summary["data_epochs"] == pytest.approx(seen * first["data_epochs"] / first["tokens_seen"])
    with open(new_dir / "metrics.csv", newline="") as f:
        logged = [float(row["train/tokens_seen"]) for row in csv.DictReader(f) if row["train/tokens_seen"]]
    assert logged == [20 * 1024 + 2048 * n for n in range(1, 5)]  # after each of steps 21-24
    assert torch.load(new_dir / "checkpoints" / "last.ckpt", weights_only=False)["tokens_seen"] == seen


@pytest.mark.parametrize("moved", [True, False], ids=["the run folder moved", "a new run from its checkpoint"])
def test_kept_checkpoints_follow_a_moved_folder_only(moved: bool, tmp_path: Path):
    """A new run from another run's checkpoint took on that run's best loss (maybe on another validation set), so
    its best.ckpt was compared against it, and that run's kept files under its own folder's name."""
    old, new = tmp_path / "old" / "checkpoints", tmp_path / "new" / "checkpoints"
    new.mkdir(parents=True)
    if moved:
        (new / "best.ckpt").write_bytes(b"")
    callback = FolderCheckpoint(dirpath=new, filename="best", monitor="val/loss", mode="min", save_top_k=1)
    best = str(old / "best.ckpt")
    state = {"dirpath": str(old), "best_model_path": best, "best_model_score": torch.tensor(3.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's on a changed dirpath
        callback.load_state_dict({**state, "best_k_models": {best: torch.tensor(3.0)}, "last_model_path": ""})
    assert callback.best_model_score == (torch.tensor(3.0) if moved else None)
    assert list(callback.best_k_models) == ([str(new / "best.ckpt")] if moved else [])


@pytest.mark.slow
def test_a_checkpoint_beside_its_runs_config_is_read_as_in_checkpoints(
    xsa_run, data_cache, tmp_path, monkeypatch, capsys
):
    """Where `xsa-lm consolidate` writes its one file (RUN/last-full.ckpt): generate finds the run's tokenizer."""
    run_dir = tmp_path / "run"
    shutil.copytree(xsa_run, run_dir)
    shutil.copy(run_dir / "checkpoints" / "last.ckpt", run_dir / "last-full.ckpt")
    out = cli_in_process(
        ["generate", f"ckpt={run_dir / 'last-full.ckpt'}", "max_new_tokens=8"],
        data_cache,
        tmp_path,
        monkeypatch,
        capsys,
    )
    assert out.returncode == 0, out.stderr[-2000:]


def preempted(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "status": "preempted"}))


def step_20_in_last_ckpt_alone(run_dir: Path) -> None:  # as after a SIGTERM between two step checkpoints
    (run_dir / "checkpoints" / "step-000020.ckpt").unlink()  # last.ckpt, a link to it, keeps step 20


def with_config(edit: Callable[[str], str]) -> Callable[[Path], None]:
    return lambda run_dir: (run_dir / "config.yaml").write_text(edit((run_dir / "config.yaml").read_text()))


LAST, EARLIER = "checkpoints/last.ckpt", "checkpoints/step-000010.ckpt"
RESUMES = {  # (damage to a copy of the run, its checkpoint or None, into the run's own folder, overrides) -> the line
    "another attention": ((None, None, True, ["attention=sa"]), ["attention.name: xsa -> sa", "drop these overrides"]),
    "another model size": ((None, None, True, ["model.n_layer=3"]), ["model.n_layer: 2 -> 3", "drop these"]),
    "another lr": ((None, None, True, ["optim.lr=1e-2"]), ["optim.lr: 0.003 -> 0.01", "drop these overrides"]),
    "another batch": ((None, None, True, ["global_batch_tokens=2048"]), ["global_batch_tokens: 1024 -> 2048"]),
    "another seed": ((None, None, True, ["seed=1"]), ["seed: 0 -> 1", "drop these overrides"]),
    # Without its config.yaml, or with a damaged one, it would train the defaults over the run's results; with one
    # edited by hand, another run than its checkpoints' under the same record.
    "config.yaml removed": (
        (lambda run_dir: (run_dir / "config.yaml").unlink(), None, True, ["trainer.max_steps=30"]),
        ["holds a run but no config.yaml"],
    ),
    "config.yaml not yaml": (
        (with_config(lambda text: text + "optim: [unclosed\n"), None, True, ["trainer.max_steps=30"]),
        ["config.yaml is not valid YAML at line"],
    ),
    "config.yaml edited": (
        (
            with_config(lambda text: text.replace("  lr: 0.003\n", "  lr: 0.01\n", 1)),
            None,
            True,
            ["trainer.max_steps=30"],
        ),
        ["config.yaml differs from the config", "optim.lr: 0.003 -> 0.01"],
    ),
    # It trained nothing and recorded the checkpoint's result as a completed run of trainer.max_steps.
    "a new run from a checkpoint at its last step": (
        (None, LAST, False, ["trainer.max_steps=20"]),
        ["is at step 20, at or past trainer.max_steps=20", "raise trainer.max_steps"],
    ),
    # It recorded a run of 15 steps in config.yaml that had trained 20.
    "continuing past a lower max_steps": (
        (preempted, None, True, ["trainer.max_steps=15"]),
        ["has reached step 20, past trainer.max_steps=15", "raise trainer.max_steps"],
    ),
    # It replaced the run's result and left the discarded steps' checkpoints beside the new ones.
    "a rewind into the run's own folder": (
        (None, EARLIER, True, []),
        ["is at step 10, but the run", "has gone on to step 20", "another hydra.run.dir"],
    ),
    "a rewind, the furthest step in last.ckpt alone": (
        (step_20_in_last_ckpt_alone, EARLIER, True, []),
        ["is at step 10, but the run", "has gone on to step 20"],
    ),
    "another model": ((None, LAST, False, ["model.d_model=96"]), ["another model", "d_model: 64 -> 96"]),
    # The checkpoint's AdamW state would set the LR, weight decay, betas and eps back, under a record of the new ones.
    "optimizer settings its state would undo": (
        (None, LAST, False, ["optim.lr=0.01", "optim.weight_decay=0.5", "trainer.max_steps=30"]),
        ["optimizer state", "optim.lr: 0.003 -> 0.01; optim.weight_decay: 0.1 -> 0.5"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case, expected", RESUMES.values(), ids=RESUMES.keys())
def test_a_resume_that_would_falsify_the_record_is_refused(
    case, expected, xsa_run, data_cache, tmp_path, monkeypatch, capsys
):
    damage, checkpoint, in_place, overrides = case
    run_dir, new_dir = tmp_path / "run", tmp_path / "new"
    shutil.copytree(xsa_run, run_dir)
    if damage:
        damage(run_dir)
    before = snapshot(run_dir)
    resume = f"resume={run_dir / checkpoint}" if checkpoint else "resume=auto"
    args = [*(["train"] if in_place else XSA), *overrides, resume, f"hydra.run.dir={run_dir if in_place else new_dir}"]
    assert_clean_error(cli_in_process(args, data_cache, tmp_path, monkeypatch, capsys), "resume:", *expected)
    assert snapshot(run_dir) == before and not new_dir.exists()


@pytest.mark.slow
@pytest.mark.long
def test_a_second_run_into_a_busy_directory_is_refused(data_cache: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    args = [*XSA, "trainer.max_steps=5000", f"hydra.run.dir={run_dir}"]  # long enough to outlive both refusals
    first = start(args, data_cache, tmp_path)
    wait_for(run_dir / "checkpoints" / "step-000010.ckpt", first)
    for second_args in (args, [*args, "resume=auto"]):
        second = run_cli(second_args, data_cache, tmp_path)
        assert_clean_error(second, f"{run_dir} is in use by another xsa-lm train run (pid {first.pid})")
    assert first.poll() is None, "the first run ended before the second one was tried"
    first.send_signal(signal.SIGTERM)  # end it early, cleanly; its files must be its own
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["attention"] == "xsa"
    assert sorted(train_losses(run_dir)) == list(range(summary["steps"]))
    assert not list((run_dir / "checkpoints").glob("*-v1.ckpt")) and not (run_dir / ".xsa-lm.lock").exists()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path: Path):
    (tmp_path / ".xsa-lm.lock").write_text("999999\n")  # written by a process that died: no flock is held
    with hold_directory(tmp_path, ".xsa-lm.lock", "xsa-lm train run"):
        assert (tmp_path / ".xsa-lm.lock").read_text() == f"{os.getpid()}\n"
        holder = subprocess.run(
            [
                sys.executable,
                "-c",
                "from pathlib import Path; from xsa_lm.locking import "
                f"hold_directory; hold_directory(Path({str(tmp_path)!r}), '.xsa-lm.lock', 'run').__enter__()",
            ],
            capture_output=True,
            text=True,
        )
        assert holder.returncode != 0 and f"in use by another run (pid {os.getpid()})" in holder.stderr
    assert not (tmp_path / ".xsa-lm.lock").exists()


@pytest.mark.slow
@pytest.mark.long  # the same clean stop as SIGTERM's, which make test rehearses (test_reliability.py)
def test_ctrl_c_checkpoints_exits_130_and_resumes_exactly(data_cache: Path, tmp_path: Path):
    args = [*XSA, "trainer.max_steps=40"]
    straight = run_cli([*args, f"hydra.run.dir={tmp_path / 'straight'}"], data_cache, tmp_path)
    assert straight.returncode == 0, straight.stderr[-2000:]
    run_dir = tmp_path / "run"
    stopped = stop_mid_run([*args, f"hydra.run.dir={run_dir}"], signal.SIGINT, data_cache=data_cache, cwd=tmp_path)
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert f"xsa-lm train hydra.run.dir={run_dir} resume=auto" in stopped.stdout and "Traceback" not in stopped.stderr
    again = run_cli(["train", f"hydra.run.dir={run_dir}", "resume=auto"], data_cache, tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert train_losses(run_dir) == train_losses(tmp_path / "straight")


def test_a_second_ctrl_c_aborts_at_once(monkeypatch):
    from xsa_lm.train.callbacks import Preemption

    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    preemption = Preemption(Path("last.ckpt"), val_every_steps=10)
    preemption._handle(signal.SIGINT, None)
    assert preemption.received == "SIGINT" and exits == []  # the first one asks for a clean stop
    preemption._handle(signal.SIGINT, None)
    assert exits == [130]


def test_continuation_takes_the_saved_config_and_only_free_changes(tmp_path: Path):
    saved = OmegaConf.create(
        {
            "seed": 0,
            "resume": None,
            "attention": {"name": "xsa"},
            "optim": {"lr": 1e-2},
            "trainer": {"max_steps": 100},
            "scheduler": {"total_steps": 100, "min_lr_ratio": 0.1},
            "val_every_steps": 10,
        }
    )
    OmegaConf.save(saved, tmp_path / "config.yaml")
    defaults = OmegaConf.merge(saved, {"attention": {"name": "sa"}, "optim": {"lr": 1e-3}})
    given = OmegaConf.merge(defaults, {"resume": "auto", "trainer": {"max_steps": 200}, "val_every_steps": 20})
    given, defaults = OmegaConf.to_container(given), OmegaConf.to_container(defaults)
    config, notes = continuation_config(given, defaults, ["resume=auto", "trainer.max_steps=200"], tmp_path)
    assert config["attention"]["name"] == "xsa" and config["optim"]["lr"] == 1e-2 and config["resume"] == "auto"
    assert config["trainer"]["max_steps"] == 200 and config["val_every_steps"] == 20
    assert notes[:2] == ["trainer.max_steps: 100 -> 200", "val_every_steps: 10 -> 20"]
    assert "steps 100-200 run at the final LR 0.001" in notes[-1]
    # naming a group on the command line counts even when its value is the default
    with pytest.raises(UserError, match="attention.name: xsa -> sa"):
        continuation_config(defaults, defaults, ["attention=sa"], tmp_path)
    # no saved config (resume=PATH into a new directory): the given config as it is
    assert continuation_config(given, defaults, [], tmp_path / "new") == (given, [])


@pytest.mark.slow
@pytest.mark.long  # two runs (~17 s)
def test_a_last_step_off_the_validation_grid_still_reaches_best_ckpt(data_cache: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    out = run_cli([*XSA, "trainer.max_steps=25", f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [h["step"] for h in summary["val_history"]] == [10, 20, 25]
    with open(run_dir / "metrics.csv", newline="") as f:  # each validation's row numbered as Lightning's loop does
        rows = [(row["epoch"], row["step"]) for row in csv.DictReader(f) if row["val/loss"]]
    assert rows == [("0", "9"), ("0", "19"), ("0", "24")]
    best_step = min(summary["val_history"], key=lambda h: h["val_loss"])["step"]
    assert torch.load(run_dir / "checkpoints" / "best.ckpt", weights_only=False)["global_step"] == best_step
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 25
    command = json.loads((run_dir / "run_info.json").read_text())["command"]
    assert command[1] == "train"  # the whole command line, runnable as it is
    assert "GPU available" not in out.stderr and "Trainer.fit` stopped" not in out.stderr
    # A resume with nothing left to train leaves the finished run as it is.
    before = snapshot(run_dir)
    again = run_cli(["train", f"hydra.run.dir={run_dir}", "resume=auto"], data_cache, tmp_path)
    assert again.returncode == 0 and "nothing to train" in again.stdout
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_the_default_run_directory_is_made_once(data_cache: Path, tmp_path: Path):
    """The default hydra.run.dir holds the time: the CLI's check must not leave a folder of its own time behind."""
    out = run_cli(["train", *FAST, "trainer.max_steps=2", "val_every_steps=2"], data_cache, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    folders = list((tmp_path / "outputs" / "train").iterdir())
    assert len(folders) == 1 and (folders[0] / "summary.json").exists()
    # FAST's warmup (5 steps) is longer than these 2: clipped, said once, saved, and the LR reached the peak.
    assert out.stdout.count("scheduler.warmup_steps=5 is longer than the LR schedule's 2 steps") == 1
    assert "warmup_steps: 2\n" in (folders[0] / "config.yaml").read_text()
    assert json.loads((folders[0] / "summary.json").read_text())["peak_lr"] == pytest.approx(3e-3)


ANALYZE = ["ckpts=[a.ckpt]"]
FOLDERS = [  # (command, its arguments, what the folder holds) -> the line after `hydra.run.dir=<folder> `
    ("train", FAST, "sweep.json", "holds an `xsa-lm sweep` (sweep.json): xsa-lm train would overwrite its files"),
    ("train", FAST, "scale.json", "holds an `xsa-lm scale` study (scale.json): xsa-lm train"),
    ("sweep", FAST, "summary.json", "holds a training run (summary.json): xsa-lm sweep"),
    ("scale", FAST, "checkpoints/", "holds a training run (checkpoints/): xsa-lm scale"),
    ("sweep", FAST, "scale.json", "holds an `xsa-lm scale` study (scale.json): xsa-lm sweep"),
    ("train", FAST, "eval.json", "holds an `xsa-lm eval` (eval.json): xsa-lm train"),
    ("sweep", FAST, "results.json", "holds a study's results (results.json) without the sweep.json or scale.json"),
    ("scale", FAST, "results.json", "holds a study's results (results.json) without the sweep.json or scale.json"),
    ("analyze", ANALYZE, "diagnostics.csv", "holds the results of an earlier xsa-lm analyze (diagnostics.csv): it"),
    ("eval", ANALYZE, "eval.json", "holds the results of an earlier xsa-lm eval (eval.json): it would overwrite them"),
]


@pytest.mark.parametrize(("command", "args", "mark", "expected"), FOLDERS)
def test_a_command_never_writes_into_another_commands_folder(
    command, args, mark, expected, monkeypatch, capsys, tmp_path
):
    """Nor over its own earlier results where it does not resume. Refused before Hydra runs (Hydra would write its
    own files there first): nothing in the folder changes."""
    folder = tmp_path / "theirs"
    (folder / mark).parent.mkdir(parents=True, exist_ok=True)
    (folder / "checkpoints").mkdir() if mark.endswith("/") else (folder / mark).write_text("{}")
    before = snapshot(folder), sorted(p.name for p in folder.iterdir())
    err = refused_in_process([command, *args, f"hydra.run.dir={folder}"], monkeypatch, capsys)
    assert err.startswith(f"xsa-lm: error: hydra.run.dir={folder} {expected}") and err.count("\n") == 1, err
    assert err.endswith("; choose a new hydra.run.dir\n")
    assert (snapshot(folder), sorted(p.name for p in folder.iterdir())) == before


@pytest.mark.parametrize("command", ["train", "sweep", "analyze"])
def test_no_command_writes_inside_a_training_runs_folder(command, monkeypatch, capsys, tmp_path):
    run = tmp_path / "a"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run_info.json").write_text("{}")
    args = [*FAST] if command != "analyze" else ANALYZE
    err = refused_in_process([command, *args, f"hydra.run.dir={run / 'checkpoints'}"], monkeypatch, capsys)
    expected = f"hydra.run.dir={run / 'checkpoints'} is inside the training run {run} (run_info.json): choose a"
    assert err.startswith(f"xsa-lm: error: {expected}") and err.count("\n") == 1, err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "run_info.json"]
    assert not any((run / "checkpoints").iterdir())


def test_a_training_run_inside_a_study_folder_is_refused_by_every_job(tmp_path: Path):
    """Also where the command is not started by xsa-lm (python -m, HYDRA_FULL_ERROR=1): the job's own check."""
    from xsa_lm.config.command_line import check_job

    (tmp_path / "sweep.json").write_text("{}")
    with pytest.raises(UserError, match="holds an `xsa-lm sweep` \\(sweep.json\\)"):
        check_job("train", {}, {}, tmp_path)


def test_a_run_folder_given_as_the_checkpoint_is_told_both_ways_on(tmp_path: Path):
    from xsa_lm.model import GPTConfig
    from xsa_lm.train.run import find_resume_checkpoint

    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    expected = f"^resume: {tmp_path / 'old'} is a run folder, not a checkpoint: continue it with .* resume=auto"
    with pytest.raises(UserError, match=expected):
        find_resume_checkpoint(str(tmp_path / "old"), tmp_path / "new", GPTConfig())


def test_resume_auto_in_the_default_folder_is_refused_naming_the_newest_run(
    data_cache: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """The default hydra.run.dir is named by the time, so resume=auto there never found the run and started a new
    one from scratch, saying so in a line easily missed; it is refused, naming the newest run beside it."""
    runs = tmp_path / "outputs" / "train"
    for name in ("2026-01-01_00-00-00_tiny_sa", "2026-01-02_00-00-00_tiny_xsa"):
        (runs / name).mkdir(parents=True)
        (runs / name / "config.yaml").write_text("")
    os.utime(runs / "2026-01-01_00-00-00_tiny_sa" / "config.yaml", (0, 0))
    refused = cli_in_process(["train", *FAST, "resume=auto"], data_cache, tmp_path, monkeypatch, capsys)
    assert_clean_error(
        refused,
        "resume=auto continues the run in hydra.run.dir, which was not given",
        f"hydra.run.dir={runs / '2026-01-02_00-00-00_tiny_xsa'}",
    )
    assert sorted(p.name for p in runs.iterdir()) == ["2026-01-01_00-00-00_tiny_sa", "2026-01-02_00-00-00_tiny_xsa"]


@pytest.mark.long
def test_resume_auto_writes_a_damaged_summary_of_a_completed_run_again(data_cache: Path, tmp_path: Path) -> None:
    """A completed run whose summary.json was cut short (a full disk, a partial copy) was refused by every resume
    with "run the command that wrote it again": resume=auto writes it again from the last checkpoint. The same
    command again is no change of config, though its warmup (5) was clipped to the 2 steps of the schedule. Its
    first time, resume=auto in a new folder started the run from scratch."""
    args = [
        "train",
        *FAST,
        "trainer.max_steps=2",
        "val_every_steps=2",
        "resume=auto",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    started = run_cli(args, data_cache, tmp_path)
    assert started.returncode == 0 and "holds no run yet: starting a new run from scratch" in started.stdout
    summary = tmp_path / "run" / "summary.json"
    whole = json.loads(summary.read_text())
    summary.write_text(summary.read_text()[:100])
    again = run_cli(args, data_cache, tmp_path)  # the same command, as a sweep retries a trial
    assert again.returncode == 0, again.stderr[-2000:]
    rewritten = json.loads(summary.read_text())
    assert (rewritten["status"], rewritten["steps"]) == ("completed", 2)
    assert rewritten["final_val_loss"] == pytest.approx(whole["final_val_loss"])
