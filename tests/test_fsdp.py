"""FSDP2 (trainer=fsdp) on CPU with 2 gloo processes: the same training as one process, one checkpoint file."""

import csv
import json
from pathlib import Path

import pytest

from tests.conftest import FAST, run_cli
from xsa_lm.checkpoints import load_model

pytestmark = pytest.mark.slow
ARGS = [a for a in FAST if a != "trainer=cpu"] + ["attention=xsa", "trainer.max_steps=10", "val_every_steps=5"]
FSDP = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


def grad_norms(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/grad_norm"]) for r in csv.DictReader(f) if r.get("train/grad_norm")}


def test_fsdp2_trains_as_one_process_and_its_checkpoint_resumes_alone(data_cache: Path, tmp_path: Path):
    """Global batch 1024 tokens: one process accumulates 2 micro-batches, FSDP2 runs 1 on each of 2 ranks. The
    clipped norm is the global one (every shard), so it equals the single process's at every step."""
    single = run_cli(["train", *ARGS, "trainer=cpu", f"hydra.run.dir={tmp_path / 'single'}"], data_cache, tmp_path)
    sharded = run_cli(["train", *ARGS, *FSDP, f"hydra.run.dir={tmp_path / 'fsdp'}"], data_cache, tmp_path)
    assert single.returncode == 0 and sharded.returncode == 0, sharded.stderr[-3000:]
    assert "x 1 accumulation x 2 device(s)" in sharded.stdout
    a, b = grad_norms(tmp_path / "single"), grad_norms(tmp_path / "fsdp")
    assert sorted(a) == sorted(b) == list(range(10))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5)
    history = {name: json.loads((tmp_path / name / "summary.json").read_text())["val_history"]
               for name in ("single", "fsdp")}  # fmt: skip
    for x, y in zip(history["single"], history["fsdp"], strict=True):
        assert x["step"] == y["step"] and y["val_loss"] == pytest.approx(x["val_loss"], rel=1e-5)
    # One consolidated file: it loads as a plain model and continues in one process.
    assert load_model(tmp_path / "fsdp" / "checkpoints" / "last.ckpt").config.attention == "xsa"
    resumed = run_cli(["train", f"hydra.run.dir={tmp_path / 'fsdp'}", "resume=auto", "trainer=cpu",
                       "trainer.devices=1", "trainer.max_steps=12"], data_cache, tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "fsdp" / "summary.json").read_text())["steps"] == 12


def test_fsdp_refuses_the_rank_zero_callbacks(data_cache: Path, tmp_path: Path):
    out = run_cli(["train", *ARGS, *FSDP, "samples.every_n_steps=5", f"hydra.run.dir={tmp_path / 'run'}"],
                  data_cache, tmp_path)  # fmt: skip
    assert out.returncode == 2 and "samples.every_n_steps: not available under trainer=fsdp" in out.stderr
    assert not (tmp_path / "run").exists()


def test_a_nan_stops_every_rank_with_a_clean_checkpoint(data_cache: Path, tmp_path: Path):
    """The non-finite flag comes from the global norm, so both ranks skip the update and stop at the same step."""
    import torch

    run_dir = tmp_path / "run"
    out = run_cli(["train", *ARGS, *FSDP, "faults.inject_nan_at_step=7", f"hydra.run.dir={run_dir}"], data_cache,
                  tmp_path, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 7 and summary["steps"] == 8
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 8 and all(torch.isfinite(t).all() for t in last["state_dict"].values())
