"""Diagnostics during training, `xsa-lm analyze` on SA and XSA checkpoints, and the paper recipes' CPU twins."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FAST, REPO, assert_nothing_written, assert_refused, run_cli
from tests.wandb_records import history

pytestmark = pytest.mark.slow
TOYS = sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*_toy.yaml"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("analyze")
    runs = {}
    for attention in ("sa", "xsa"):
        logger = [] if attention == "xsa" else ["logger=csv"]  # the XSA run also logs to W&B (offline)
        fast = [o for o in FAST if o != "logger=csv"]
        args = [*fast, *logger, f"attention={attention}", "trainer.max_steps=20", "diagnostics.every_n_steps=10"]
        args += ["samples.every_n_steps=10", "samples.max_new_tokens=8", "samples.prompt=KING:"]
        proc = run_cli(["train", *args, f"hydra.run.dir={root / attention}"], data_cache, root)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[attention] = root / attention
    return runs


def test_diagnostics_are_logged_during_training(checkpoints: dict[str, Path]):
    with open(checkpoints["xsa"] / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("diag/cos_z_v/layer_1")]
    assert [int(r["step"]) for r in rows] == [10, 20]  # after optimizer steps 10 and 20
    assert all(abs(float(r["diag/cos_z_v/layer_1"])) < 1e-3 for r in rows)
    with open(checkpoints["sa"] / "metrics.csv") as f:
        header = next(csv.reader(f))
    assert "diag/a_ii/layer_0" in header and "diag/cos_z_v/layer_0" not in header  # SA has no z
    wandb_file = next(checkpoints["xsa"].glob("wandb/offline-run-*/run-*.wandb"))
    logged = {key for row in history(wandb_file) for key in row}
    assert any(key.startswith("diag/table") for key in logged) and "diag/a_ii/layer_0" in logged
    # text samples during training: in samples.txt and as a W&B table
    samples = (checkpoints["xsa"] / "samples.txt").read_text()
    assert samples.count("=== step ") == 2 and samples.count("KING:") == 2
    assert any(key.startswith("samples") for key in logged)


def test_analyze_writes_csv_png_and_table(checkpoints: dict[str, Path], data_cache: Path, tmp_path: Path):
    ckpts = [checkpoints[a] / "checkpoints" / "last.ckpt" for a in ("sa", "xsa")]
    out = tmp_path / "analysis"
    args = ["analyze", f"ckpts=[{ckpts[0]},{ckpts[1]}]", "sequences=6", "chunk=16", f"hydra.run.dir={out}"]
    proc = run_cli(args, data_cache, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "diagnostics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"checkpoint", "layer", "cos_v_v", "a_ii", "cos_y_v", "cos_z_v"} <= set(rows[0])
    assert len(rows) == 4 and [r["layer"] for r in rows] == ["0", "1", "0", "1"]  # 2 checkpoints x 2 layers
    sa, xsa = rows[:2], rows[2:]
    assert all(r["cos_z_v"] == "" for r in sa) and all(abs(float(r["cos_z_v"])) < 1e-3 for r in xsa)
    assert all(0 < float(r["a_ii"]) <= 1 for r in rows)
    assert (out / "diagnostics.png").read_bytes()[:4] == b"\x89PNG"
    assert [r["label"] for r in rows] == ["sa", "sa", "xsa", "xsa"]  # the run names, which say the attention once
    assert "cos_y_v" in proc.stdout and "\nxsa " in proc.stdout
    # the paper's own Figure 1 overlaid on ours
    fig = tmp_path / "fig1.png"
    plot_script = REPO / "scripts" / "plot_paper_fig1.py"
    cmd = [sys.executable, str(plot_script), str(out / "diagnostics.csv"), "--out", str(fig)]
    script = subprocess.run(cmd, capture_output=True, text=True)
    assert script.returncode == 0, script.stderr and fig.read_bytes()[:4] == b"\x89PNG"
    missing = run_cli(["analyze", "ckpts=[/no/such.ckpt]", f"hydra.run.dir={tmp_path / 'x'}"], data_cache, tmp_path)
    assert missing.returncode == 2 and "checkpoint not found" in missing.stderr


REFUSED = {
    "the run's config.yaml": (["ckpts=[{run}/config.yaml]"], ["ckpts: ", "config.yaml", "not a checkpoint"]),
    "the run directory": (["ckpts=[{run}]"], ["ckpts: ", "is a directory", "checkpoints/last.ckpt"]),
    "sequences=0": (["ckpts=[{ckpt}]", "sequences=0"], ["sequences must be an integer >= 1, got 0"]),
    "chunk=0": (["ckpts=[{ckpt}]", "chunk=0"], ["chunk must be an integer >= 1, got 0"]),
    "batch_size=-1": (["ckpts=[{ckpt}]", "batch_size=-1"], ["batch_size must be an integer >= 1, got -1"]),
    "labels of another count": (["ckpts=[{ckpt}]", "labels=[a,b]"], ["labels: 2 labels for 1 checkpoints"]),
}


@pytest.mark.parametrize("args, expected", REFUSED.values(), ids=REFUSED.keys())
def test_analyze_refuses_in_one_line(
    args: list[str], expected: list[str], checkpoints: dict[str, Path], data_cache: Path, tmp_path: Path
):
    run = checkpoints["xsa"]
    args = [a.format(run=run, ckpt=run / "checkpoints" / "last.ckpt") for a in args]
    out = tmp_path / "analysis"
    assert_refused(run_cli(["analyze", *args, f"hydra.run.dir={out}"], data_cache, tmp_path), *expected)
    assert_nothing_written(out)


@pytest.mark.long
@pytest.mark.parametrize("toy", TOYS)
def test_every_toy_recipe_trains_a_few_steps(toy: str, data_cache: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    args = ["train", f"experiment={toy}", "trainer.max_steps=3", "val_every_steps=3", "data.val_windows=16"]
    args += ["logger=csv", "progress_bar=false", f"hydra.run.dir={run_dir}"]
    proc = run_cli(args, data_cache, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3


@pytest.mark.long
def test_a_toy_study_runs_its_whole_grid(data_cache: Path, tmp_path: Path):
    args = ["train", "--multirun", "experiment=paper_sinks_toy", "trainer.max_steps=2", "val_every_steps=2"]
    args += ["data.val_windows=16", "logger=csv", "progress_bar=false", f"hydra.sweep.dir={tmp_path / 'multi'}"]
    proc = run_cli(args, data_cache, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "multi").glob("*/summary.json"))]
    configs = {(s["attention"], s["model_config"]["n_sinks"]) for s in summaries}
    assert configs == {(a, n) for a in ("sa", "xsa") for n in (0, 1, 4)}
