"""End to end: with no W&B API key a training run logs offline, and its .wandb file holds the metrics, the config,
the dashboard's axes and summaries, and the artifacts (report files, checkpoints with logger.wandb.log_model)."""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import PIL.Image
import pytest
import torch

from tests.conftest import FAST, cli_env
from tests.helpers import compose_train, refused_in_process
from tests.wandb_records import config, history, records_of, run_files, summary

LR = 2e-3
MAX_STEPS = 5


def train_offline(tmp_path: Path, data_cache: Path, name: str, *overrides: str) -> tuple[Path, Path, str]:
    """A tiny run with logger=wandb and no WANDB_MODE, API key or ~/.netrc: "auto" has to choose offline by itself.
    HOME is tmp_path, so W&B's copies of logged artifact files land there. Returns the run dir, its .wandb file and
    its stdout."""
    run_dir = tmp_path / name
    env = cli_env(data_cache, home=tmp_path)
    del env["WANDB_MODE"]
    args = [sys.executable, "-m", "xsa_lm.train", *FAST, "logger=wandb", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_file,) = run_files(run_dir)
    return run_dir, run_file, proc.stdout


@pytest.mark.slow
def test_offline_run_file_holds_history_config_and_the_best_and_last_checkpoints(tmp_path: Path, data_cache: Path):
    # The last step (5) is off the validation grid: validated, and checkpointed, all the same.
    overrides = [f"optim.lr={LR}", f"trainer.max_steps={MAX_STEPS}", "val_every_steps=2", "logger.wandb.log_model=true"]
    run_dir, run_file, stdout = train_offline(tmp_path, data_cache, "run", *overrides)
    assert "wandb sync" in stdout

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
    run_summary = json.loads((run_dir / "summary.json").read_text())
    assert len(val_losses) == 3
    assert val_losses == pytest.approx([v["val_loss"] for v in run_summary["val_history"]])

    cfg = config(run_file)
    assert (cfg["attention"]["name"], cfg["model"]["name"], cfg["optim"]["lr"]) == ("sa", "tiny", LR)
    assert cfg["trainer"]["max_steps"] == MAX_STEPS and cfg["data"]["cache_dir"] == str(data_cache)
    assert compose_train(["logger=wandb"]).logger.wandb.log_model is False  # by default no checkpoint leaves

    check_axes_and_summary(run_file, rows, val_losses)
    # The documented way to look inside an offline run without uploading it.
    args = [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", str(run_dir / "wandb")]
    shown = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "val/loss.min" in shown.stdout and "final_val_loss" in shown.stdout, shown.stdout[:2000]

    logged = records_of(run_file, "artifact")
    run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    assert {(a.name, a.type) for a in logged} == {(f"model-{run_id}", "model")}
    originals = {json.loads(a.metadata)["original_filename"]: a for a in logged}  # the newest version of each
    # Only the val/loss callback's files: the step-NNNNNN.ckpt copies would take the `best` alias.
    assert set(originals) == {"best.ckpt", "last.ckpt"}, sorted(originals)
    assert "best" in originals["best.ckpt"].aliases and "best" not in originals["last.ckpt"].aliases
    for artifact in logged:
        (entry,) = artifact.manifest.contents
        assert entry.path == "model.ckpt" and Path(entry.local_path).is_file()  # the copy wandb sync uploads
        assert Path(entry.local_path).is_relative_to(tmp_path)
    (last,) = originals["last.ckpt"].manifest.contents
    assert torch.load(last.local_path, map_location="cpu", weights_only=False)["global_step"] == MAX_STEPS


def check_axes_and_summary(run_file: Path, rows: list[dict], val_losses: list[float]) -> None:
    """Curves over tokens seen (validation rows carry the last value logged), val/loss summarised by min and last."""
    definitions = {m.name or m.glob_name: m for m in records_of(run_file, "metric")}
    assert definitions["*"].step_metric == "train/tokens_seen" and definitions["*"].options.step_sync
    assert (definitions["val/loss"].summary.min, definitions["val/loss"].summary.last) == (True, True)
    assert "train/tokens_seen" in definitions and "trainer/global_step" in definitions
    seen = 0.0
    for row in rows:
        if "train/loss" in row:
            seen = row["train/tokens_seen"]
            assert seen == (row["trainer/global_step"] + 1) * 1024  # FAST: global_batch_tokens=1024
        elif "val/loss" in row:
            assert row["train/tokens_seen"] == seen, row
    assert summary(run_file)["val/loss"] == pytest.approx({"min": min(val_losses), "last": val_losses[-1]})


def test_log_model_must_be_false_true_or_all(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    refused = refused_in_process(["train", "model=tiny", "logger.wandb.log_model=yes"], monkeypatch, capsys)
    assert refused.startswith("xsa-lm: error: logger.wandb.log_model=yes must be") and "all" in refused
    assert not (tmp_path / "wandb").exists()  # refused before a run is made


def sweep_result(folder: Path) -> tuple[object, object]:
    from xsa_lm.sweep.report import ComparisonStats, SweepResult, log_to_wandb

    comparison = ComparisonStats(seeds=[], sa=[], xsa=[], diff=[])
    results = SweepResult(sweep_dir=str(folder), sweep_id="toy sweep:1", train_overrides=[], grid=[3e-3], seeds=[],
                          search_seeds=[0], selected_lr=3e-3, comparison=comparison)  # fmt: skip
    return results, log_to_wandb


def scale_result(folder: Path) -> tuple[object, object]:
    from xsa_lm.scale.report import ScaleStudyResult, log_to_wandb

    fit = {"formula": "L = E + A C^-a", "rms_residual": 0.01, "flags": [{"flag": "compute_span", "reason": "8x"}]}
    results = ScaleStudyResult(
        study_dir=str(folder), study_id="toy-study", overrides=[], models=[], fit=fit, across_sizes={}, sizes=[]
    )
    return results, log_to_wandb


@pytest.mark.parametrize(
    ("result", "pngs", "name", "kind"),
    [
        (sweep_result, ["lr_sweep.png", "curves.png"], "toy-sweep-1-report", "sweep-report"),  # W&B's characters
        (scale_result, ["loss_vs_compute.png", "multiplier.png"], "toy-study-scale-report", "scale-report"),
    ],
)
def test_a_report_run_saves_the_report_files_as_an_artifact(result, pngs, name, kind, tmp_path: Path, monkeypatch):
    from xsa_lm.reporting import ReportRunSettings

    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))  # W&B's copies of the files
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "report.md").write_text("# report\n")
    for png in pngs:
        PIL.Image.new("RGB", (1, 1)).save(tmp_path / png)
    results, log_to_wandb = result(tmp_path)
    log_to_wandb(results, tmp_path, ReportRunSettings(mode="offline"))
    (run_file,) = run_files(tmp_path)
    # logging a wandb.Table adds an artifact of type run_table
    (artifact,) = [a for a in records_of(run_file, "artifact") if a.type == kind]
    entries = {entry.path: entry for entry in artifact.manifest.contents}
    assert (artifact.name, artifact.type) == (name, kind)
    assert set(entries) == {"results.json", "report.md", *pngs}
    assert Path(entries["report.md"].local_path).read_text() == "# report\n"
    assert Path(entries["report.md"].local_path).is_relative_to(tmp_path / "wandb-data")


def test_eval_scores_of_two_checkpoints_of_one_run_keep_their_own_keys(tmp_path: Path, monkeypatch) -> None:
    """Both rows go to the training run's W&B run (its id): the final model's scores under eval/, another checkpoint's
    and a limited evaluation's under their own prefixes, so that neither replaces the final model's."""
    from xsa_lm.eval.run import EvalResult, Row, Score, log_to_wandb

    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "wandb_run_id.txt").write_text("trainrun1\n")

    def row(name: str, value: float) -> Row:
        scores = {"piqa": Score(metric="acc", value=value, n=1, stderr=None)}
        return Row(
            checkpoint=str(run_dir / "checkpoints" / name), attention="sa", run="run", scores=scores, average=value
        )

    rows = [row("last.ckpt", 0.6), row("step-000004.ckpt", 0.5)]
    log_to_wandb(EvalResult(tasks=["piqa"], limit=None, rows=rows), "offline")
    log_to_wandb(EvalResult(tasks=["piqa"], limit=10, rows=[row("last.ckpt", 0.9)]), "offline")
    files = run_files(run_dir)
    assert [f.name for f in files] == ["run-trainrun1.wandb"] * 3  # one W&B run, resumed by each row
    merged: dict = {}
    for run_file in files:
        merged |= summary(run_file)  # as W&B merges the resumed run's summaries on upload
    scores = {key: value for key, value in merged.items() if key.startswith("eval")}
    expected = {"eval": 0.6, "eval-step-000004": 0.5, "eval-limit10": 0.9}
    assert scores == {f"{prefix}/{key}": v for prefix, v in expected.items() for key in ("piqa", "average")}


def test_the_run_file_reader_waits_for_a_file_the_service_is_still_writing(tmp_path: Path, monkeypatch) -> None:
    """W&B's service may write a run file after run.finish() has returned: the tests' reader waits for the file and its
    exit record, and reads a half-written chunk as not yet there rather than as a bad checksum."""
    import threading

    import wandb

    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    run = wandb.init(mode="offline", dir=str(tmp_path / "done"), id="r1", settings=wandb.Settings(silent=True))
    run.summary.update({"score": 0.5})
    run.finish()
    (written,) = run_files(tmp_path / "done")
    whole, late = written.read_bytes(), tmp_path / "late" / "wandb" / "offline-run-20261204_000000-r1"
    late.mkdir(parents=True)

    def service() -> None:  # the file appears, then its header and half of its last chunk, then the rest
        for size in (0, 7, len(whole) - 5, len(whole)):
            time.sleep(0.3)
            (late / written.name).write_bytes(whole[:size])

    writer = threading.Thread(target=service)
    writer.start()
    assert summary(run_files(tmp_path / "late")[0])["score"] == 0.5  # read once the exit record is there
    writer.join()
