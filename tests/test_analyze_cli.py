"""Diagnostics during training, `xsa-lm analyze` on SA and XSA checkpoints (diagnostics and held-out loss), `eval` and
`generate` on them, and the paper recipes' CPU twins."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest.mock import Mock

import pytest
import torch
from omegaconf import OmegaConf

import xsa_lm.analysis.run as analysis_run
from tests.helpers import FAST, REPO, TINY, cli_in_process, run_cli, write_local_task
from tests.wandb_records import history, run_files, summary
from xsa_lm.analysis.losses import held_out_loss
from xsa_lm.checkpoints.load import run_data
from xsa_lm.data.datamodule import PackedWindows
from xsa_lm.data.tokenizer import token_byte_lengths
from xsa_lm.files import read_csv
from xsa_lm.model import GPT, GPTConfig

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
    rows = [r for r in read_csv(checkpoints["xsa"] / "metrics.csv")[1] if r.get("diag/cos_z_v/layer_1")]
    assert [int(r["step"]) for r in rows] == [10, 20]  # after optimizer steps 10 and 20
    assert all(abs(float(r["diag/cos_z_v/layer_1"])) < 1e-3 for r in rows)
    header = read_csv(checkpoints["sa"] / "metrics.csv")[0]
    assert "diag/a_ii/layer_0" in header and "diag/cos_z_v/layer_0" not in header  # SA has no z
    wandb_file = run_files(checkpoints["xsa"])[0]  # the training run (then eval's, in the same run id)
    logged = {key for row in history(wandb_file) for key in row}
    assert any(key.startswith("diag/table") for key in logged) and "diag/a_ii/layer_0" in logged
    # text samples during training: in samples.txt and as a W&B table
    samples = (checkpoints["xsa"] / "samples.txt").read_text()
    assert samples.count("=== step ") == 2 and samples.count("KING:") == 2
    assert any(key.startswith("samples") for key in logged)


@pytest.mark.long
def test_analyze_writes_csv_png_and_tables_of_the_loss_its_run_validated(
    checkpoints: dict[str, Path], data_cache: Path, tmp_path: Path
):
    """On the windows the runs validated on, analyze's loss, bpb and loss per span are the runs' own final validation
    (summary.json); the spans average back to the loss; bpb is the loss over the targets' bytes, counted here."""
    val_windows = OmegaConf.load(checkpoints["sa"] / "config.yaml").data.val_windows
    assert isinstance(val_windows, int)  # FAST's data.val_windows=64; null would mean every window
    ckpts = [checkpoints[a] / "checkpoints" / "last.ckpt" for a in ("sa", "xsa")]
    out = tmp_path / "analysis"
    args = ["analyze", f"ckpts=[{ckpts[0]},{ckpts[1]}]", f"sequences={val_windows}", "chunk=16"]
    proc = run_cli([*args, f"hydra.run.dir={out}"], data_cache, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(out / "diagnostics.csv")[1]
    assert {"checkpoint", "layer", "cos_v_v", "a_ii", "cos_y_v", "cos_z_v"} <= set(rows[0])
    assert len(rows) == 4 and [r["layer"] for r in rows] == ["0", "1", "0", "1"]  # 2 checkpoints x 2 layers
    sa, xsa = rows[:2], rows[2:]
    assert all(r["cos_z_v"] == "" for r in sa) and all(abs(float(r["cos_z_v"])) < 1e-3 for r in xsa)
    assert all(0 < float(r["a_ii"]) <= 1 for r in rows)
    assert (out / "diagnostics.png").read_bytes()[:4] == b"\x89PNG"
    assert [r["label"] for r in rows] == ["sa", "sa", "xsa", "xsa"]  # the run names, which say the attention once
    assert "cos_y_v" in proc.stdout and "\n| xsa " in proc.stdout
    spans = [f"span_{i}" for i in range(1, 9)]  # position_buckets: 8 by default, as training's val_position_buckets
    header, rows = read_csv(out / "losses.csv")
    assert header == ["checkpoint", "label", "data", "windows", "loss", "bpb", *spans]
    assert [r["label"] for r in rows] == ["sa", "xsa"]
    for attention, row in zip(("sa", "xsa"), rows, strict=True):
        run = checkpoints[attention]
        ckpt = run / "checkpoints" / "last.ckpt"
        assert row["checkpoint"] == str(ckpt)
        cfg = OmegaConf.load(run / "config.yaml")
        data = run_data(ckpt)
        windows = PackedWindows(data.shards("val"), cfg.data.block_size)
        n = min(cfg.data.val_windows, len(windows))  # the windows the run validated on (TokenDataModule.val_set)
        assert int(row["windows"]) == n and row["data"] == data.dir.name
        loss, bpb, by_span = float(row["loss"]), float(row["bpb"]), [float(row[s]) for s in spans]
        # The strongest check: the run's own final validation, on the same windows and weights (last.ckpt is
        # written after the last validation), by the training module's code.
        final = json.loads((run / "summary.json").read_text())
        assert loss == pytest.approx(final["final_val_loss"], abs=1e-4)
        assert bpb == pytest.approx(final["final_val_bpb"], abs=1e-4)
        assert by_span == pytest.approx(final["final_val_loss_by_position"], abs=1e-4)
        # 8 equal spans of the window (block_size a multiple of 8), no ignored target in real windows: every span
        # holds the same number of tokens, so their plain mean is the loss.
        assert cfg.data.block_size % 8 == 0
        assert sum(by_span) / len(by_span) == pytest.approx(loss, rel=1e-9)
        # bpb = loss / (ln 2 x bytes per token), the bytes of each target from the tokenizer's own pieces.
        targets = torch.stack([windows[i][1] for i in range(n)])
        lengths = token_byte_lengths(data.tokenizer, data.tokenizer.get_vocab_size())
        nbytes = sum(lengths[t] for t in targets.flatten().tolist())
        assert 0 < nbytes and bpb == pytest.approx(loss / (math.log(2) * nbytes / targets.numel()), rel=1e-9)
    assert (out / "positions.png").read_bytes()[:4] == b"\x89PNG"
    # The printed table, then XSA - SA per span (4 decimals), and the files named in the last line.
    assert "bpb" in proc.stdout and "span_8" in proc.stdout
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("xsa - sa per span: ")]
    printed = [float(v) for v in line.removeprefix("xsa - sa per span: ").split(" (loss")[0].split()]
    expected = [float(rows[1][s]) - float(rows[0][s]) for s in spans]
    assert printed == pytest.approx(expected, abs=1e-4)
    assert "losses.csv" in proc.stdout.splitlines()[-1] and "positions.png" in proc.stdout.splitlines()[-1]
    # the paper's own Figure 1 overlaid on ours
    fig = tmp_path / "fig1.png"
    plot_script = REPO / "scripts" / "plot_paper_fig1.py"
    cmd = [sys.executable, str(plot_script), str(out / "diagnostics.csv"), "--out", str(fig)]
    script = subprocess.run(cmd, capture_output=True, text=True)
    assert script.returncode == 0, script.stderr and fig.read_bytes()[:4] == b"\x89PNG"
    for args, said in (  # each ended in a traceback, or wrote over the figure
        ([str(out / "diagnostics.csv"), "--out", str(fig)], "exists: choose another file"),
        ([str(out / "losses.csv"), "--out", str(tmp_path / "f.png")], "is not a diagnostics.csv of xsa-lm analyze"),
        ([str(out / "nope.csv")], "no such file"),
    ):
        refused = subprocess.run([sys.executable, str(plot_script), *args], capture_output=True, text=True)
        assert refused.returncode == 2 and said in refused.stderr.splitlines()[-1], refused.stderr


def test_an_interrupted_analyze_can_be_run_again_into_its_folder(
    checkpoints: dict[str, Path], data_cache: Path, tmp_path: Path, monkeypatch, capsys
):
    """diagnostics.csv marks a finished analyze's folder: written before the figures, a Ctrl-C during them left a
    folder that the same command then refused as earlier results."""
    out, ckpt = tmp_path / "analysis", checkpoints["sa"] / "checkpoints" / "last.ckpt"
    relative = os.path.relpath(ckpt, tmp_path)  # the command runs in tmp_path
    args = ["analyze", f"ckpts=[{relative}]", "sequences=4", "chunk=16", f"hydra.run.dir={out}"]
    with monkeypatch.context() as patch:
        patch.setattr(analysis_run, "positions_figure", Mock(side_effect=KeyboardInterrupt))
        first = cli_in_process(args, data_cache, tmp_path, monkeypatch, capsys)
    assert first.returncode == 130 and not (out / "diagnostics.csv").exists()
    assert first.stderr == "xsa-lm: interrupted (Ctrl-C) during xsa-lm analyze\n"  # the command, not an argument
    again = cli_in_process(args, data_cache, tmp_path, monkeypatch, capsys)
    assert again.returncode == 0, again.stderr
    assert (out / "diagnostics.csv").is_file() and (out / "positions.png").is_file()
    for written in ("diagnostics.csv", "losses.csv"):  # the checkpoint's path as it is from anywhere
        assert {row["checkpoint"] for row in read_csv(out / written)[1]} == {str(ckpt)}


@pytest.mark.long
def test_eval_and_generate_through_the_cli(checkpoints: dict[str, Path], data_cache: Path, tmp_path: Path):
    """`xsa-lm eval` of both checkpoints on two local tasks: the table, eval.json with each score's n and standard
    error, XSA - SA with its interval, the scores in the XSA run's own W&B run; a hub task offline fails fast naming
    the task; greedy `xsa-lm generate` is deterministic."""
    ckpts = {attention: run / "checkpoints" / "last.ckpt" for attention, run in checkpoints.items()}
    task = write_local_task(tmp_path / "tasks")
    script = REPO / "scripts" / "make_shakespeare_cloze.py"  # a second local task, from the held-out plays
    made = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path / "tasks"), "--items", "20"], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    cloze, out = tmp_path / "tasks" / "shakespeare_cloze.yaml", tmp_path / "eval"
    args = ["eval", f"ckpts=[{ckpts['sa']},{ckpts['xsa']}]", f"tasks=[{task},{cloze}]", f"hydra.run.dir={out}"]
    proc = run_cli(args, data_cache, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "not a git repository" not in proc.stderr  # the harness's own git call, outside a repository
    result = json.loads((out / "eval.json").read_text())
    assert result["tasks"] == ["xsa_toy_mc", "shakespeare_cloze"]
    assert [r["attention"] for r in result["rows"]] == ["sa", "xsa"]
    for row in result["rows"]:
        toy, score = row["scores"]["xsa_toy_mc"], row["scores"]["shakespeare_cloze"]
        assert toy["metric"] == "acc_norm" and 0 <= toy["value"] <= 1
        assert row["average"] == pytest.approx((toy["value"] + score["value"]) / 2)
        expected = math.sqrt(score["value"] * (1 - score["value"]) / 19)  # 0/1 items: sd (n - 1) / sqrt(n)
        assert score["n"] == 20 and score["stderr"] == pytest.approx(expected)
    diff = result["rows"][1]["average"] - result["rows"][0]["average"]
    assert result["xsa_minus_sa"]["average"] == pytest.approx(diff)
    table = (out / "eval.md").read_text()
    assert "| XSA - SA |" in table and "xsa_toy_mc (acc_norm, n=4)" in table and "| XSA - SA |" in proc.stdout
    assert "shakespeare_cloze (acc_norm, n=20)" in table and "| 95% CI, paired over items |" in table
    ci = result["xsa_minus_sa_ci95"]["shakespeare_cloze"]
    assert ci is None or ci[0] <= result["xsa_minus_sa"]["shakespeare_cloze"] <= ci[1]
    xsa_runs = run_files(checkpoints["xsa"])
    assert len(xsa_runs) == 2  # training, then the eval scores in the same run id
    assert summary(xsa_runs[-1])["eval/xsa_toy_mc"] == pytest.approx(result["rows"][1]["scores"]["xsa_toy_mc"]["value"])

    args = ["eval", f"ckpts=[{ckpts['sa']}]", "tasks=[boolq]", f"hydra.run.dir={tmp_path / 'x'}"]
    missing = run_cli(args, data_cache, tmp_path, timeout=300)
    assert missing.returncode == 2 and "boolq" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1

    args = ["generate", f"ckpt={ckpts['xsa']}", "prompt=ROMEO:", "max_new_tokens=12", "temperature=0"]
    first, second = run_cli(args, data_cache, tmp_path), run_cli(args, data_cache, tmp_path)
    assert first.returncode == 0 and first.stdout == second.stdout and first.stdout.count("ROMEO:") == 1


def test_losses_of_other_data_are_listed_but_not_subtracted():
    """Two checkpoints of runs on other corpora or tokenizers, or on windows of another length (other tokens, other
    positions in each span): a difference of their losses means nothing."""

    def row(label: str, data: str, loss: float, block_size: int = 128) -> dict:
        measured_on = {"data": data, "windows": 8, "block_size": block_size}
        return {"label": label} | measured_on | {"loss": loss, "bpb": loss / 2, "span_1": loss}

    rows = [row("sa", "shakespeare-1", 4.0), row("xsa", "shakespeare-1", 3.5), row("loc", "local-2", 2.0)]
    table = analysis_run.render([], [*rows, row("short", "shakespeare-1", 2.0, block_size=64)])
    assert "xsa - sa per span: -0.5000 (loss -0.5000)" in table
    against = "against 8 windows of 128 tokens of shakespeare-1)"
    assert f"loc - sa: not compared (measured on 8 windows of 128 tokens of local-2, {against}" in table
    assert f"short - sa: not compared (measured on 8 windows of 64 tokens of shakespeare-1, {against}" in table
    assert "short - sa per span" not in table


def test_held_out_loss_weighs_each_span_by_its_tokens():
    """Unequal spans (12 positions in 5) and ignored targets (-1): each span is the mean over its own tokens, the
    loss their token-weighted mean, equal to the model's own mean cross-entropy; bpb over the counted bytes."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    x, y = torch.randint(0, 64, (5, 12)), torch.randint(0, 64, (5, 12))
    y[1, 7:], y[3, :2] = -1, -1
    lengths = [i % 4 for i in range(64)]  # some tokens stand for no byte (EOT, specials)
    result = held_out_loss(model, x, y, token_bytes=lengths, buckets=5, batch_size=2)
    assert model.training  # left as found
    model.eval()
    with torch.no_grad():
        logits, mean = model(x, y)
    token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, ignore_index=-1, reduction="none")
    counted = y != -1
    span = torch.arange(12) * 5 // 12  # positions per span: 3, 2, 3, 2, 2
    tokens = [int(counted[:, span == k].sum()) for k in range(5)]
    assert result.windows == 5 and result.tokens == int(counted.sum()) == sum(tokens)
    assert result.loss == pytest.approx(float(mean), rel=1e-6)
    expected = [float(token_loss[:, span == k].sum()) / tokens[k] for k in range(5)]
    assert result.by_position == pytest.approx(expected, rel=1e-6)
    nbytes = sum(lengths[t] for t in y[counted].tolist())
    assert result.bpb == pytest.approx(float(token_loss.sum()) / (math.log(2) * nbytes), rel=1e-6)
    no_bytes = held_out_loss(model, x, y, token_bytes=None, buckets=24, batch_size=5)  # more spans than positions
    assert no_bytes.bpb is None and no_bytes.loss == pytest.approx(result.loss, rel=1e-9)
    assert no_bytes.by_position.count(None) == 12  # spans without positions have no loss, not 0


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
