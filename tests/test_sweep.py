"""The paper's protocol: grid, selection, statistics, trial outcomes, and whole sweeps through `xsa-lm sweep`."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FAST, cli_env, run_cli
from tests.test_eval import write_local_task
from tests.wandb_records import config, history, run_record, summary
from xsa_lm.errors import UserError
from xsa_lm.sweep.protocol import Trial, compare_trials, lr_grid, paired_ci, select_lr, t_quantile_975
from xsa_lm.sweep.report import build_results, render_markdown
from xsa_lm.sweep.run import train_overrides
from xsa_lm.sweep.trials import device_slots, outcome

# FAST without the keys the sweep sets for each trial (optim.lr, progress_bar).
SWEEP_FAST = [o for o in FAST if not o.startswith(("optim.lr=", "progress_bar="))]


# --- the grid and the selection -------------------------------------------------------------------------------


def test_lr_grid_from_a_list_or_a_log_range() -> None:
    assert lr_grid([3e-3, 1e-3, 3e-3], None) == [1e-3, 3e-3]
    assert lr_grid(None, {"min": 1e-4, "max": 1e-2, "num": 3}) == pytest.approx([1e-4, 1e-3, 1e-2])
    assert lr_grid(None, {"min": 1e-4, "max": 1e-3, "num": 2}) == [1e-4, 1e-3]
    with pytest.raises(UserError, match="sweep.lrs"):
        lr_grid([], None)
    with pytest.raises(UserError, match="positive"):
        lr_grid([1e-3, -1e-3], None)
    with pytest.raises(UserError, match="min < max"):
        lr_grid(None, {"min": 1e-2, "max": 1e-4, "num": 3})


def test_selection_takes_the_lowest_loss_and_no_warning_inside_the_grid() -> None:
    results = {1e-4: ("completed", 3.2), 3e-4: ("completed", 3.0), 1e-3: ("completed", 3.1)}
    selection = select_lr(results, diverge_above=10.0)
    assert selection.lr == 3e-4 and selection.warnings == []


def test_selection_tie_goes_to_the_smaller_lr() -> None:
    results = {1e-4: ("completed", 3.5), 3e-4: ("completed", 3.0), 1e-3: ("completed", 3.0), 3e-3: ("completed", 3.4)}
    assert select_lr(results, diverge_above=10.0).lr == 3e-4


def test_diverged_runs_are_never_selected() -> None:
    # A diverged run's loss (or a loss above the bound) never wins, however low it looks.
    results = {1e-4: ("completed", 3.3), 3e-4: ("completed", 3.1), 1e-3: ("diverged", 0.5), 3e-3: ("completed", 12.0)}
    selection = select_lr(results, diverge_above=10.0)
    assert selection.lr == 3e-4
    assert selection.losses[1e-3] is None and selection.losses[3e-3] is None
    nan = {1e-4: ("completed", 3.3), 3e-4: ("completed", math.nan), 1e-3: ("completed", 3.4)}
    assert select_lr(nan, diverge_above=10.0).lr == 1e-4


def test_all_diverged_selects_nothing_and_says_so() -> None:
    selection = select_lr({1e-3: ("diverged", None), 1e-2: ("completed", math.inf)}, diverge_above=10.0)
    assert selection.lr is None
    assert any("no LR is usable" in w for w in selection.warnings)


@pytest.mark.parametrize(("best", "side"), [(1e-4, "lowest"), (1e-3, "highest")])
def test_best_lr_on_the_edge_of_the_grid_warns(best: float, side: str) -> None:
    results = {lr: ("completed", 3.0 if lr == best else 3.5) for lr in (1e-4, 3e-4, 1e-3)}
    selection = select_lr(results, diverge_above=10.0)
    assert selection.lr == best
    assert len(selection.warnings) == 1 and side in selection.warnings[0] and "extend the grid" in selection.warnings[0]


def test_a_grid_of_one_lr_warns_that_nothing_was_searched() -> None:
    selection = select_lr({3e-4: ("completed", 3.0)}, diverge_above=10.0)
    assert selection.lr == 3e-4
    assert len(selection.warnings) == 1 and "holds one LR (0.0003)" in selection.warnings[0]


def test_failed_search_runs_are_named_for_a_retry() -> None:
    results = {1e-4: ("completed", 3.3), 3e-4: ("failed", None), 1e-3: ("completed", 3.1), 3e-3: ("completed", 3.2)}
    selection = select_lr(results, diverge_above=10.0)
    assert selection.lr == 1e-3
    assert "0.0003" in selection.warnings[0] and "retry" in selection.warnings[0]


def test_compare_trials_reuse_the_search_run_at_the_selected_lr() -> None:
    trials = compare_trials(3e-4, [0, 1])
    assert Trial("sa", 3e-4, 0) in trials  # the same trial (same id) as the search's run at that LR and seed
    assert Trial("sa", 3e-4, 0).id == "sa_lr0.0003_s0"
    assert sorted((t.attention, t.seed) for t in trials) == [("sa", 0), ("sa", 1), ("xsa", 0), ("xsa", 1)]


# --- statistics ----------------------------------------------------------------------------------------------


def test_paired_confidence_interval_uses_student_t() -> None:
    lo, hi = paired_ci([1.0, 2.0, 3.0])  # mean 2, std 1, t(0.975, 2 dof) = 4.303
    half = 4.303 / math.sqrt(3)
    assert (lo, hi) == pytest.approx((2 - half, 2 + half))
    assert paired_ci([0.5]) is None
    assert t_quantile_975(1) == 12.706
    assert t_quantile_975(31) == pytest.approx(2.03951, abs=1e-4)  # exact values from tables of Student's t
    assert t_quantile_975(40) == pytest.approx(2.02108, abs=1e-4)
    assert t_quantile_975(120) == pytest.approx(1.97993, abs=1e-4)


# --- trial outcomes ------------------------------------------------------------------------------------------


def _summary(status: str = "completed", loss: float | None = 4.0, vocab: int = 512) -> dict:
    return {"status": status, "error": None, "final_val_loss": loss, "diverged_at_step": 7 if status == "diverged"
            else None, "model_config": {"vocab_size": vocab}, "val_history": []}  # fmt: skip


def test_outcome_of_trial_processes() -> None:
    assert outcome(0, _summary(), "", None)["status"] == "completed"
    # ln(512) = 6.24: a final loss above a uniform guess counts as diverged; an explicit bound replaces it.
    high = outcome(0, _summary(loss=7.0), "", None)
    assert high["status"] == "diverged" and "6.238" in high["error"]
    assert outcome(0, _summary(loss=5.0), "", diverge_above=4.5)["status"] == "diverged"
    nan = outcome(0, _summary(status="diverged", loss=None), "", None)
    assert nan["status"] == "diverged" and "step 7" in nan["error"]
    killed = outcome(-9, None, "", None)
    assert killed["status"] == "failed" and "SIGKILL" in killed["error"]
    crashed = outcome(1, None, "xsa-lm: error: data.files matched nothing", None)
    assert crashed == {"status": "failed", "error": "xsa-lm: error: data.files matched nothing"}
    assert outcome(1, _summary(), "RuntimeError: boom", None)["status"] == "failed"


def test_parallel_trials_get_their_own_gpus() -> None:
    assert device_slots(2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert device_slots(3, ["0", "1", "2", "3"]) == ["0", "1", "2"]
    assert device_slots(2, []) == [None, None]  # CPU: trials share the machine
    assert device_slots(1, ["0", "1"]) == [None]  # one trial: it sees every GPU (and may use DDP)
    with pytest.raises(UserError, match="max_parallel"):
        device_slots(4, ["0", "1"])


def test_training_overrides_pass_through_and_sweep_keys_stay() -> None:
    kept = train_overrides(["model=tiny", "trainer.max_steps=10", "sweep.lrs=[1e-3]", "sweep=demo", "+foo=1"])
    assert kept == ["model=tiny", "trainer.max_steps=10", "+foo=1"]
    for bad, hint in [("optim.lr=1e-3", "sweep.lrs"), ("attention=xsa", "both"), ("seed=3", "sweep.seeds")]:
        with pytest.raises(UserError, match=hint):
            train_overrides([bad])


def test_report_without_a_usable_lr_says_the_comparison_did_not_run(tmp_path: Path) -> None:
    trials = [{"phase": "search", "attention": "sa", "lr": lr, "seed": 0, "status": "diverged", "final_val_loss": None}
              for lr in (1e-2, 1e-1)]  # fmt: skip
    selection = select_lr({1e-2: ("diverged", None), 1e-1: ("diverged", None)}, diverge_above=10.0)
    results = build_results(tmp_path, "s", [1e-2, 1e-1], [0], [], trials, selection, None)
    markdown = render_markdown(results)
    assert "no LR is usable" in markdown and "Not run: the search selected no LR" in markdown
    assert results["selected_lr"] is None and results["comparison"]["seeds"] == []


# --- whole sweeps --------------------------------------------------------------------------------------------


def _trial_wandb_file(run_dir: Path) -> Path:
    return next(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


@pytest.mark.slow
def test_sweep_end_to_end(tmp_path: Path, data_cache: Path) -> None:
    """Two LRs (one diverges), two seeds, XSA tuned too: the whole protocol, the report and W&B records."""
    sweep_dir = tmp_path / "sweep"
    with_wandb = [o for o in SWEEP_FAST if o != "logger=csv"]
    args = ["sweep", *with_wandb, "trainer.max_steps=20", "val_every_steps=10", "sweep.lrs=[3e-3,1e3]",
            "sweep.seeds=[0,1]", "sweep.tune_xsa=true", "sweep.launch_prefix=[env,'XSA_LM_VIA_PREFIX=1']",
            "sweep.max_parallel=2",
            f"hydra.run.dir={sweep_dir}"]  # fmt: skip
    proc = run_cli(args, data_cache, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((sweep_dir / "results.json").read_text())
    assert results["selected_lr"] == 3e-3
    by_key = {(t["phase"], t["attention"], t["lr"], t["seed"]): t for t in results["trials"]}
    assert by_key[("search", "sa", 1e3, 0)]["status"] == "diverged"  # lr 1000: NaN or a loss above ln(V)
    assert by_key[("search", "xsa", 1e3, 0)]["status"] == "diverged"
    for attention in ("sa", "xsa"):
        for seed in (0, 1):
            trial = by_key[("compare", attention, 3e-3, seed)]
            assert trial["status"] == "completed" and trial["final_val_loss"] < math.log(512)
            assert {"phase", "attention", "lr", "seed", "status", "final_val_loss"} <= set(trial)
    # The compare phase reuses the search's runs at seed 0 (SA, and XSA because tune_xsa searched it too).
    assert by_key[("compare", "sa", 3e-3, 0)]["reused"] and by_key[("compare", "xsa", 3e-3, 0)]["reused"]
    assert not by_key[("compare", "sa", 3e-3, 1)]["reused"]
    assert len(list((sweep_dir / "runs").iterdir())) == 6  # 4 search + 2 new compare runs, none twice
    record = json.loads((sweep_dir / "trials" / "xsa_lr0.003_s1.json").read_text())
    assert record["command"][:2] == ["env", "XSA_LM_VIA_PREFIX=1"]  # sweep.launch_prefix wraps every trial
    spans = sorted((t["started"], t["finished"]) for t in results["trials"] if t["phase"] == "search")
    overlaps = [b_start < a_end for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False)]
    assert any(overlaps), "sweep.max_parallel=2 ran the search trials one after another"
    compare = results["comparison"]
    assert compare["seeds"] == [0, 1] and compare["diff_ci95"] is not None
    assert compare["diff_mean"] == pytest.approx(sum(compare["xsa"]) / 2 - sum(compare["sa"]) / 2)
    assert any("lowest LR of the grid" in w for w in results["warnings"])
    assert results["xsa_tuning"]["selected_lr"] == 3e-3

    report = (sweep_dir / "report.md").read_text()
    for text in ("## 1. LR search", "| 1000 |", "diverged", "## 2. SA vs XSA", "mean ± std", "95% CI",
                 "## 3. XSA at its own best LR", "extend the grid"):  # fmt: skip
        assert text in report, text
    assert "## 2. SA vs XSA" in proc.stdout  # the report is printed at the end
    for plot in ("lr_sweep.png", "curves.png"):
        assert (sweep_dir / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # W&B: every trial in the sweep's group with its phase as job_type, final metrics in the run summary.
    record = run_record(_trial_wandb_file(sweep_dir / "runs" / "sa_lr0.003_s1"))
    assert (record.run_group, record.job_type) == ("sweep", "compare")
    search_run = _trial_wandb_file(sweep_dir / "runs" / "sa_lr0.003_s0")
    assert run_record(search_run).job_type == "lr-search"
    assert summary(search_run)["final_val_loss"] == pytest.approx(by_key[("search", "sa", 3e-3, 0)]["final_val_loss"])
    run_config = config(search_run)
    assert (run_config["attention"]["name"], run_config["optim"]["lr"], run_config["seed"]) == ("sa", 3e-3, 0)
    report_run = next(sweep_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert (run_record(report_run).run_group, run_record(report_run).job_type) == ("sweep", "report")
    assert summary(report_run)["selected_lr"] == 3e-3
    logged = {key for row in history(report_run) for key in row}
    for name in ("report/trials", "report/lr_sweep", "report/curves"):  # media rows: report/lr_sweep/height, ...
        assert any(key.startswith(name) for key in logged), (name, sorted(logged))

    # The same command again: every trial is reused, nothing retrained, the results are the same.
    again = run_cli(args, data_cache, tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "started" not in again.stdout and again.stdout.count("(reused)") == 8
    assert json.loads((sweep_dir / "results.json").read_text())["comparison"] == compare

    # Other training overrides in the same directory: refused, nothing touched.
    other = run_cli([*args, "trainer.max_steps=30"], data_cache, tmp_path, timeout=120)
    assert other.returncode == 2 and "same overrides" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_killed_sweep_resumes_without_rerunning_finished_trials(tmp_path: Path, data_cache: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    task = write_local_task(tmp_path / "tasks")  # the compare runs are also evaluated on a local harness task
    args = ["sweep", *SWEEP_FAST, "trainer.max_steps=60", "val_every_steps=10", "sweep.lrs=[1e-3,3e-3]",
            "sweep.seeds=[0]", f"sweep.eval_tasks=[{task}]", f"hydra.run.dir={sweep_dir}"]  # fmt: skip
    cmd = [sys.executable, "-m", "xsa_lm.cli", *args]
    out = open(tmp_path / "sweep.out", "w")  # closed after the kill
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(data_cache), stdout=out, stderr=subprocess.STDOUT)
    first, second = sweep_dir / "trials" / "sa_lr0.001_s0.json", sweep_dir / "trials" / "sa_lr0.003_s0.json"
    deadline = time.time() + 300
    while not (second.exists() and (sweep_dir / "runs" / "sa_lr0.003_s0" / "metrics.csv").exists()):
        assert proc.poll() is None and time.time() < deadline, "the sweep ended before its second trial started"
        time.sleep(0.2)
    proc.kill()  # SIGKILL: no handler runs; the trial in flight must not outlive the sweep
    proc.wait()
    out.close()
    in_flight = json.loads(second.read_text())
    assert in_flight["status"] == "running"
    _wait_until_gone(in_flight["pid"])
    finished = json.loads(first.read_text())
    assert finished["status"] == "completed"
    finished_summary = (sweep_dir / "runs" / "sa_lr0.001_s0" / "summary.json").read_bytes()

    again = run_cli(args, data_cache, tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert "sa_lr0.001_s0 already completed (reused)" in again.stdout
    assert "sa_lr0.001_s0 started" not in again.stdout
    assert (sweep_dir / "runs" / "sa_lr0.001_s0" / "summary.json").read_bytes() == finished_summary
    retried = json.loads(second.read_text())
    assert retried["status"] == "completed" and retried["attempt"] == 2
    # The interrupted attempt continued from its checkpoint, or (none yet) was kept aside and started afresh.
    assert retried["resumed_from_checkpoint"] or (sweep_dir / "runs" / "sa_lr0.003_s0.attempt1").is_dir()
    results = json.loads((sweep_dir / "results.json").read_text())
    assert {t["status"] for t in results["trials"]} == {"completed"}
    assert {(t["phase"], t["attention"]) for t in results["trials"]} == {("search", "sa"), ("compare", "sa"),
                                                                         ("compare", "xsa")}  # fmt: skip
    assert [row["attention"] for row in results["eval"]["rows"]] == ["sa", "xsa"]
    assert "## 4. Downstream evaluation" in (sweep_dir / "report.md").read_text() and "| XSA - SA |" in again.stdout


@pytest.mark.slow
def test_sigterm_stops_the_trial_in_flight_and_records_it(tmp_path: Path, data_cache: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "xsa_lm.cli", "sweep", *SWEEP_FAST, "trainer.max_steps=200", "sweep.lrs=[1e-3]",
           "sweep.seeds=[0]", f"hydra.run.dir={sweep_dir}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(data_cache), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    record_file = sweep_dir / "trials" / "sa_lr0.001_s0.json"
    deadline = time.time() + 120
    while not (sweep_dir / "runs" / "sa_lr0.001_s0" / "metrics.csv").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.2)
    pid = json.loads(record_file.read_text())["pid"]
    proc.send_signal(signal.SIGTERM)  # what SLURM and `kill` send
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "interrupted (SIGTERM); run the same command to resume" in stderr
    assert json.loads(record_file.read_text())["status"] == "interrupted"
    _wait_until_gone(pid)


def _wait_until_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        stat = Path(f"/proc/{pid}/stat")
        try:
            if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":  # gone, or a zombie
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"trial process {pid} outlived the killed sweep")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=1e-3", "optim.lr is set by the sweep"),
        ("sweep.lrs=[]", "needs an LR grid"),
        ("sweep.seeds=[0,0]", "distinct integers"),
        ("sweep.max_parallel=0", "max_parallel must be at least 1"),
    ],
)
def test_sweep_bad_inputs_fail_in_one_line(tmp_path: Path, data_cache: Path, override: str, message: str) -> None:
    proc = run_cli(["sweep", *SWEEP_FAST, override, f"hydra.run.dir={tmp_path / 'sweep'}"], data_cache, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "sweep" / "sweep.json").exists() and not (tmp_path / "sweep" / "runs").exists()
