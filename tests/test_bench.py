"""The training benchmark runs end to end and writes the keys the README and notes rely on (no timing asserts)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_quick(script: str, tmp_path: Path) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--quick", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_bench_train_quick_writes_the_report(tmp_path: Path):
    report, stdout = run_quick("bench_train.py", tmp_path)
    for key in ("sa_tokens_per_s", "xsa_tokens_per_s", "plain_tokens_per_s", "lightning_tokens_per_s"):
        assert report[key] > 0, key
    assert report["xsa_over_sa_step_time"] > 0 and report["lightning_over_plain_throughput"] > 0
    assert report["device"].startswith("cpu")
    assert "xsa" in stdout.lower()
    assert 0 < report["mfu"] < 1 and report["tokens_per_s"] == report["sa_tokens_per_s"] and "MFU" in stdout


@pytest.mark.slow
def test_bench_data_quick_writes_the_report(tmp_path: Path):
    report, stdout = run_quick("bench_data.py", tmp_path)
    for key in ("raw_encode_tokens_per_s", "prepare_tokens_per_s", "loader_windows_per_s", "model_windows_per_s"):
        assert report[key] > 0, key
    assert report["prepare_over_raw"] > 0 and report["loader_over_model"] > 0 and report["tokens"] > 1_000_000
    assert "target >= 0.8" in stdout
