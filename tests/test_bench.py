"""The training benchmark runs end to end and writes the keys the README and notes rely on (no timing asserts)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_quick(script: str, tmp_path: Path) -> tuple[dict, str]:  # scripts/bench_*.py --quick
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--quick", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_xsa_lm_bench_smoke_writes_the_report_and_never_overwrites(tmp_path: Path):
    out = tmp_path / "bench.json"
    args = [sys.executable, "-m", "xsa_lm.cli", "bench", "smoke=true", "model.n_layer=2", f"out={out}",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("xsa_over_sa_step_time", "xsa_over_sa_peak_memory", "lightning_over_plain_throughput"):
        assert report[key] > 0, key
    assert report["device"].startswith("cpu") and report["tokens_per_s"] == report["lightning_tokens_per_s"] > 0
    assert 0 < report["mfu"] < 1 and "measured" in report["peak_flops_source"]
    # the model's formula and torch's flop counter agree (SDPA counted through its math kernel on CPU)
    assert report["flops_per_token"] == report["flops_per_token_flop_counter"]
    # XSA keeps one more activation per layer (z, the output projection's input); SA's is SDPA's own output
    assert 1.0 < report["xsa_over_sa_peak_memory"] < 1.1
    assert "XSA/SA step time" in proc.stdout and "MFU" in proc.stdout
    again = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode != 0 and "exists" in again.stderr and json.loads(out.read_text()) == report


@pytest.mark.slow
def test_bench_data_quick_writes_the_report(tmp_path: Path):
    report, stdout = run_quick("bench_data.py", tmp_path)
    for key in ("raw_encode_tokens_per_s", "prepare_tokens_per_s", "loader_windows_per_s", "model_windows_per_s"):
        assert report[key] > 0, key
    assert report["prepare_over_raw"] > 0 and report["loader_over_model"] > 0 and report["tokens"] > 1_000_000
    assert "target >= 0.8" in stdout
