"""scripts/gpu_check.sh: refused in one line without a GPU, its summary records failed steps, and the whole pipeline
runs on CPU with the tiny model (GPU_CHECK_ALLOW_CPU=1), so its first run on a GPU is not its first run."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
BIN = str(Path(sys.executable).parent)


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def run_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_ALLOW_CPU")}
    return subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env=environment | {"XSA_LM_BIN": BIN} | env,
        capture_output=True,
        text=True,
        timeout=1500,
    )


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU")
def test_without_a_gpu_it_stops_with_one_line(tmp_path: Path):
    proc = run_check(tmp_path / "check")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no NVIDIA GPU" in proc.stderr
    assert not (tmp_path / "check").exists()


def test_the_summary_records_a_failed_step_and_fails(tmp_path: Path):
    steps = [
        {
            "name": "bench_gpt2_124m",
            "status": "ok",
            "exit_code": 0,
            "seconds": 3,
            "limit_s": 200,
            "command": "",
            "log": "logs/bench_gpt2_124m.log",
        },
        {
            "name": "train_sa",
            "status": "failed",
            "exit_code": 1,
            "seconds": 5,
            "limit_s": 120,
            "command": "",
            "log": "logs/train_sa.log",
        },
    ]
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train_sa.log").write_text("Traceback ...\nRuntimeError: CUDA out of memory\n")
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_check_summary.py"), str(tmp_path), "--mode", "gpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["ok"] and "step train_sa: failed" in summary["failures"]
    assert summary["steps"][1]["last_line"] == "RuntimeError: CUDA out of memory"
    assert "training losses are not finite (or missing)" in summary["failures"]
    assert "FAILED" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.long
def test_the_whole_check_runs_on_cpu_with_the_tiny_model(tmp_path: Path):
    out = tmp_path / "check"
    proc = run_check(out, GPU_CHECK_ALLOW_CPU="1", GPU_CHECK_BUDGET_S="1400")
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0, (summary["failures"], proc.stdout[-3000:])
    assert [s["name"] for s in summary["steps"]] == [
        "bench_gpt2_124m",
        "plan_paper_0.7b",
        "bench_paper_0.7b",
        "train_sa",
        "train_xsa",
        "eval",
        "generate",
    ]
    assert all(s["status"] == "ok" for s in summary["steps"]) and summary["ok"] and summary["mode"] == "cpu"
    assert summary["train"]["finite"] and summary["train"]["close"] and summary["generate"]
    assert {"xsa_over_sa_step_time", "lightning_over_plain_throughput"} <= set(summary["bench"]["gpt2_124m"]["ratios"])
    assert len(summary["eval"]["rows"]) == 2 and "## train" in (out / "summary.md").read_text()
    again = run_check(out, GPU_CHECK_ALLOW_CPU="1")  # an earlier check is never overwritten
    assert again.returncode == 2 and "earlier check" in again.stderr
