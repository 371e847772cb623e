"""The GPU study ready to launch (docs/gpu_study.md): `xsa-lm plan` prints each study's GPU-hours on one H100, and
`xsa-lm sweep sweep.dry_run=true` lists its trials and the effect they detect at toy size, on a CPU, writing nothing."""

import re
from pathlib import Path

import pytest

from tests.helpers import FAST, cli_in_process, refused_in_process
from tests.leftovers import caches, nothing_left_behind  # noqa: F401  # caches: a fixture
from xsa_lm.stats.paired import min_detectable_difference
from xsa_lm.sweep.trials import Launcher

# FLOPs per token at context 2048, as results/gpu_check_h200's bench counted them (its flops_per_token)
FLOPS = {"gpt2_124m": 967_901_184, "paper_0.7b": 5_446_434_816}
STUDIES = {  # experiment: (model, MFU, steps per run, runs by phase)
    "gpu_pilot": ("gpt2_124m", 0.371, 3250, {"search": 20, "compare": 16, "placebo": 8}),
    "gpu_decisive": ("paper_0.7b", 0.482, 25924, {"search": 6, "compare": 12}),
}
TOY = [o for o in FAST if not o.startswith(("optim.lr=", "progress_bar="))] + [
    "data=shakespeare",
    "tokenizer=bpe",
    "compile=false",
]


@pytest.mark.parametrize("experiment", STUDIES)
def test_plan_prints_each_studys_gpu_hours_by_phase(
    experiment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    args = ["plan", f"experiment={experiment}", "device_memory_gb=80"]
    shown = cli_in_process(args, tmp_path, tmp_path, monkeypatch, capsys)
    assert shown.returncode == 0, shown.stderr
    model, mfu, steps, runs = STUDIES[experiment]
    hours = lambda n: n * steps * 524288 * FLOPS[model] / (mfu * 989.4e12) / 3600  # noqa: E731
    rows = re.findall(r"^\| (\w+) \| (\d+) \| ([\d,.]+) \|$", shown.stdout, re.MULTILINE)
    assert {phase: int(n) for phase, n, _ in rows} == {**runs, "total": sum(runs.values())}
    for _, n, shown_hours in rows:
        assert float(shown_hours.replace(",", "")) == pytest.approx(hours(int(n)), abs=0.05)
    assert f"MFU {mfu:.1%} (XSA's, measured on one H200: results/gpu_check_h200)" in shown.stdout


@pytest.mark.parametrize(("experiment", "sd"), [("gpu_pilot", None), ("gpu_decisive", 0.124)])
def test_a_dry_run_lists_the_trials_and_the_detectable_effect_and_leaves_nothing(
    experiment: str,
    sd: float | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    caches: list[Path],  # noqa: F811
) -> None:
    """At toy size on a CPU: the study's own grid, seeds and arms; no trial starts, no folder stays."""
    monkeypatch.setattr(Launcher, "_start", lambda *_: pytest.fail("a trial started in a dry run"))
    given = [] if sd is None else [f"sweep.expected_sd={sd}"]
    args = ["sweep", f"experiment={experiment}", *TOY, *given, "sweep.dry_run=true"]
    with nothing_left_behind(tmp_path):
        shown = cli_in_process(args, tmp_path, tmp_path, monkeypatch, capsys)
    assert shown.returncode == 0, shown.stderr
    runs = STUDIES[experiment][3]
    phases = re.findall(r"^  (\w+): (\d+) runs", shown.stdout, re.MULTILINE)
    assert [(phase, int(n)) for phase, n in phases] == list(runs.items())
    seeds = runs["compare"] // 2
    if sd is None:
        assert f"over {seeds} seed pairs: unknown until its sd is measured (sweep.expected_sd=null)" in shown.stdout
    else:
        assert f"over {seeds} seed pairs: {min_detectable_difference(sd, seeds):.3g} nats at 80% power" in shown.stdout
    assert "GPU-hours: no measured MFU for model tiny" in shown.stdout


def test_scale_refuses_the_sweeps_dry_run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    stderr = refused_in_process(["scale", "experiment=scale_toy", "sweep.dry_run=true"], monkeypatch, capsys)
    assert "sweep.dry_run=true: xsa-lm scale has no dry run" in stderr


def test_plan_of_one_run_at_a_given_mfu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A training config (no sweep.*): one run's GPU-hours in one line, at mfu= where given."""
    args = ["plan", "experiment=paper_0.7b", "device_memory_gb=80", "mfu=0.5"]
    shown = cli_in_process(args, tmp_path, tmp_path, monkeypatch, capsys)
    hours = 200000 * 524288 * FLOPS["paper_0.7b"] / (0.5 * 989.4e12) / 3600
    assert f"per run ({hours:,.1f} GPU-hours) at MFU 50.0% (given: mfu=)" in shown.stdout
    assert "| phase |" not in shown.stdout
