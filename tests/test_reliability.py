"""Runs that survive faults: kill -9 and resume, a corrupt checkpoint, SIGTERM, NaN, DDP <-> single process."""

import json
import math
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, compose_train, run_cli, train_from, train_losses, wait_for
from tests.helpers import start_cli as start
from xsa_lm.checkpoints.discovery import checkpoint_step
from xsa_lm.files import read_csv, write_json
from xsa_lm.train.summary import print_summary

pytestmark = pytest.mark.slow
COMMON = ["train", *FAST, "val_every_steps=10", "scheduler.total_steps=40", "trainer.max_steps=40"]


def run_ok(*args, **kwargs) -> subprocess.CompletedProcess:
    """run_cli of a command that must succeed."""
    proc = run_cli(*args, **kwargs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def stop_mid_run(args: list[str], sig: signal.Signals, *, data_cache: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Start a run and send it `sig` once its step-10 checkpoint exists; it must have stopped between step 10 and the
    end, with last.ckpt at the step its summary.json reports."""
    run_dir = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1])
    proc = start(args, data_cache, cwd)
    wait_for(run_dir / "checkpoints" / "step-000010.ckpt", proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 10 <= summary["steps"] < 40, stderr[-2000:]
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == summary["steps"]
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    """40 steps uninterrupted: the run every interrupted one is held to."""
    root = tmp_path_factory.mktemp("straight")
    run_ok([*COMMON, f"hydra.run.dir={root / 'run'}"], data_cache, root)
    return root / "run"


@pytest.fixture(scope="module")
def straight(straight_run: Path) -> dict[int, float]:
    return train_losses(straight_run)


def test_kill_9_mid_run_then_resume_gives_identical_losses(straight, data_cache: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = start([*COMMON, f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    wait_for(run_dir / "checkpoints" / "step-000020.ckpt", proc)  # polled every 20 ms; 20 steps remain (~1 s)
    proc.kill()  # the steps it trained past the checkpoint are trained again after the resume
    proc.communicate()
    assert 19 in train_losses(run_dir)  # the rows up to a checkpoint are on disk before the checkpoint is
    assert not (run_dir / "summary.json").exists() or json.loads((run_dir / "summary.json").read_text())["steps"] < 40
    run_ok([*COMMON, "resume=auto", f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    resumed = train_losses(run_dir)
    assert resumed == straight  # every step once, bit-identical on CPU in fp32
    logged = [row["step"] for row in read_csv(run_dir / "metrics.csv")[1] if row["train/loss"]]
    assert len(logged) == len(set(logged)) == 40  # no step twice, although the killed run logged some of them
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


@pytest.mark.long
def test_corrupt_last_checkpoint_is_skipped(straight, data_cache: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    run_ok([*COMMON, "trainer.max_steps=20", f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    folder = run_dir / "checkpoints"
    last = folder / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a write cut short by a crash (not ours)
    # last.ckpt is a hard link to step 20's checkpoint (one write per checkpoint): damage in place reaches both, and
    # resume=auto falls back on the step checkpoint before it (keep_last=2).
    assert checkpoint_step(last) is None and checkpoint_step(folder / "step-000020.ckpt") is None
    assert checkpoint_step(folder / "step-000010.ckpt") == 10
    again = run_ok([*COMMON, "resume=auto", f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    assert "last.ckpt is truncated or corrupt; skipped" in again.stdout
    assert "step-000020.ckpt is truncated or corrupt; skipped" in again.stdout
    assert train_losses(run_dir) == straight
    names = {p.name for p in folder.glob("step-*.ckpt")}
    assert {"step-000030.ckpt", "step-000040.ckpt"} <= names and "step-000020.ckpt" not in names  # keep_last=2


@pytest.mark.long
def test_resume_with_another_micro_batch_split_continues_the_same_stream(straight, data_cache: Path, tmp_path: Path):
    """Stopped at step 5 with 2 micro-batches of 8 per step, resumed with 4 of 4: each later step sees the same windows
    and closes after 4 micro-batches: the straight run's losses."""
    run_dir = tmp_path / "run"
    run_ok([*COMMON, "trainer.max_steps=5", f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    run_ok([*COMMON, "micro_batch_size=4", "resume=auto", f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    resumed = train_losses(run_dir)
    assert sorted(resumed) == list(range(40))
    for step in range(5, 40):  # the same sums in another order: float rounding apart
        assert resumed[step] == pytest.approx(straight[step], rel=1e-4), step


@pytest.mark.long
def test_sigterm_checkpoints_and_exits_0_then_resumes(straight, data_cache: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    stopped = stop_mid_run([*COMMON, f"hydra.run.dir={run_dir}"], signal.SIGTERM, data_cache=data_cache, cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "preempted"
    assert "SIGTERM received" in stopped.stdout and "resume=auto" in stopped.stdout
    assert "| last val loss " in stopped.stdout  # no final loss before the last step, but where the run stood
    run_ok([*COMMON, "resume=auto", f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert train_losses(run_dir) == straight
    # The stop validated only where an uninterrupted run does (Lightning validates a run that stops early).
    assert [h["step"] for h in summary["val_history"]] == [10, 20, 30, 40]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000030.ckpt", "step-000040.ckpt"]


@pytest.mark.long
def test_nan_loss_gives_diverged_or_is_skipped_within_budget(data_cache: Path, tmp_path: Path):
    nan = [*COMMON, "faults.inject_nan_at_step=15"]
    diverged = run_ok([*nan, f"hydra.run.dir={tmp_path / 'a'}"], data_cache, tmp_path)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    # Step 15's update was skipped on the device (fused AdamW's found_inf); the host saw it at the next logging step.
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 15 and summary["steps"] == 16
    assert "last good checkpoint" in diverged.stdout
    last = torch.load(summary["checkpoints"]["last"], map_location="cpu", weights_only=True)
    assert last["global_step"] == 16 and all(torch.isfinite(t).all() for t in last["state_dict"].values())
    # spike_factor 0.5: every logged loss above half its running average counts as a spike, so events must appear
    spiky = ["faults.skip_nonfinite_batches=1", "faults.spike_factor=0.5", f"hydra.run.dir={tmp_path / 'b'}"]
    run_ok([*nan, *spiky], data_cache, tmp_path)
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 40
    assert [e["step"] for e in summary["events"] if e["event"] == "skipped_batch"] == [15]
    spikes = [e for e in summary["events"] if e["event"] == "loss_spike"]
    assert spikes and all(e["value"] > 0 for e in spikes)
    assert "events/loss_spike" in read_csv(tmp_path / "b" / "metrics.csv")[0]  # also a metric series
    # A resume goes on with the run's events: its budget of one skipped batch is spent, so the next one diverges.
    args = ["train", f"hydra.run.dir={tmp_path / 'b'}", "resume=auto", "trainer.max_steps=50"]
    run_ok([*args, "faults.inject_nan_at_step=45"], data_cache, tmp_path)
    again = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert again["status"] == "diverged" and again["diverged_at_step"] == 45
    assert again["events"][: len(summary["events"])] == summary["events"]
    quiet = json.loads((tmp_path / "a" / "summary.json").read_text())["events"]
    assert not [e for e in quiet if e["event"] == "loss_spike"]  # the default factor 3: a smooth run has none


def test_a_batch_skipped_at_the_last_step_is_in_that_steps_checkpoint(data_cache: Path, tmp_path: Path):
    """The host reads the skip flags at logging steps, and at the last step before its validation writes the
    checkpoints: a resume from them has spent the budget of one skipped batch, so its next NaN diverges."""
    run_dir = tmp_path / "run"
    args = [*COMMON, "trainer.log_every_n_steps=4", "faults.skip_nonfinite_batches=1", f"hydra.run.dir={run_dir}"]
    run_ok([*args, "trainer.max_steps=25", "faults.inject_nan_at_step=24"], data_cache, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and [h["step"] for h in summary["val_history"]] == [10, 20, 25]
    assert [e["step"] for e in summary["events"] if e["event"] == "skipped_batch"] == [24]  # the 25th step
    run_ok([*args, "resume=auto", "trainer.max_steps=30", "faults.inject_nan_at_step=28"], data_cache, tmp_path)
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["status"] == "diverged" and again["diverged_at_step"] == 28


def strict_json(path: Path) -> dict:
    """The file as a strict JSON parser reads it: NaN and Infinity are not JSON."""
    return json.loads(path.read_text(), parse_constant=lambda constant: pytest.fail(f"{path} holds {constant}"))


def test_every_json_written_is_strict_a_nan_or_infinity_null(tmp_path: Path):
    """summary.json, trial records, results.json and eval.json are written by write_json: a diverged run's NaN loss
    or an infinite LR is null there, which every JSON parser reads."""
    data = {"lr": math.inf, "best_val_loss": math.nan, "history": [{"val_loss": -math.inf}, {"val_loss": 4.5}]}
    write_json(tmp_path / "summary.json", data)
    expected = {"lr": None, "best_val_loss": None, "history": [{"val_loss": None}, {"val_loss": 4.5}]}
    assert strict_json(tmp_path / "summary.json") == expected


@pytest.mark.long  # ~5 s
def test_a_run_diverging_before_a_finite_validation_keeps_no_checkpoint(data_cache: Path, tmp_path: Path, caplog):
    """LR 1e10: the second update is NaN and the weights give a NaN validation loss; no checkpoint holds them, and
    sampling from them during training is skipped."""
    args = [*FAST, "optim.lr=1e10", "trainer.max_steps=6", "val_every_steps=2", "data.val_windows=8"]
    args += ["samples.every_n_steps=1", "samples.temperature=1.0"]  # no token can be drawn: a warning, not a crash
    cfg = compose_train([*args, f"data.cache_dir={data_cache}"])
    summary = train_from(cfg, tmp_path / "run")
    with caplog.at_level("INFO", logger="xsa_lm.train"):
        print_summary(summary)
    saved = strict_json(tmp_path / "run" / "summary.json")
    assert saved["status"] == "diverged" and saved["steps"] < 6 and saved["best_val_loss"] is None
    assert saved["checkpoints"] == {"last": None, "best": None} and not list(tmp_path.rglob("*.ckpt"))
    assert "last good checkpoint: none" in caplog.text


@pytest.mark.long
def test_ddp_matches_single_process_and_its_checkpoint_resumes_alone(straight_run, data_cache: Path, tmp_path: Path):
    """Global batch 1024 tokens: one process accumulates 2 micro-batches, DDP runs 1 on each of 2 ranks; the same
    schedule as the straight run, so its validations at steps 10, 20 and 30 are the ones to meet."""
    single = {h["step"]: h["val_loss"] for h in json.loads((straight_run / "summary.json").read_text())["val_history"]}
    args = [*COMMON, "trainer.max_steps=20", "trainer.devices=2", "trainer.strategy=ddp"]
    run_ok([*args, f"hydra.run.dir={tmp_path / 'ddp'}"], data_cache, tmp_path)
    history = json.loads((tmp_path / "ddp" / "summary.json").read_text())["val_history"]
    assert [h["step"] for h in history] == [10, 20]
    for h in history:  # float summation order differs: close
        assert h["val_loss"] == pytest.approx(single[h["step"]], abs=2e-4)
    # The DDP checkpoint continues in one process, on the same global data position.
    longer = [*COMMON, "trainer.max_steps=30", "resume=auto", f"hydra.run.dir={tmp_path / 'ddp'}"]
    run_ok(longer, data_cache, tmp_path)
    a = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert a["steps"] == 30 and a["final_val_loss"] == pytest.approx(single[30], abs=5e-4)


def test_checkpoints_move_between_compiled_and_eager_models():
    from xsa_lm.model import GPTConfig
    from xsa_lm.train.module import LMModule

    config = GPTConfig(n_layer=1, d_model=16, n_head=2, head_dim=8, vocab_size=64, block_size=8)
    make = lambda compile: LMModule(config, optimizer=None, scheduler=None, total_steps=1, compile=compile)
    eager, compiled = make(False), make(True)  # compiled in place and lazily: nothing is compiled here
    assert list(compiled.state_dict()) == list(eager.state_dict())  # the same names: nothing to rename
    for source, target in ((compiled, eager), (eager, compiled)):
        target.load_state_dict({k: v.clone() for k, v in source.state_dict().items()})  # strict: every key maps


@pytest.mark.parametrize("wrapped", [False, True], ids=["OSError", "torch's RuntimeError over it"])
def test_a_failed_checkpoint_write_leaves_the_previous_one_whole(wrapped: bool, tmp_path: Path, monkeypatch):
    from xsa_lm.checkpoints.atomic import AtomicCheckpointIO, CheckpointWriteError

    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(3)}}, path)
    before = path.read_bytes()

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"partial")
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            if not wrapped:
                raise
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointWriteError, match="No space left on device.*previous checkpoints are intact"):
        io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.zeros(3)}}, path)
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))
    assert checkpoint_step(path) == 1


def test_no_secret_lands_in_the_run_directory(data_cache: Path, tmp_path: Path):
    secret = "0123456789abcdef0123456789abcdef01234567"
    run_dir = tmp_path / "run"
    fast = [o for o in FAST if o != "logger=csv"]
    args = ["train", *fast, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"]
    proc = run_ok(args, data_cache, tmp_path, WANDB_API_KEY=secret, HF_TOKEN=secret)
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaked == [] and secret not in proc.stdout + proc.stderr
