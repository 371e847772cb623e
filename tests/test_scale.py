"""`xsa-lm scale`: the loss-vs-compute fit and the multiplier on synthetic data with known answers, and the whole
study end to end on two test-size models, killed with SIGKILL and resumed."""

import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from tests.conftest import cli_env, run_cli
from tests.golden import assert_golden
from tests.helpers import assert_clean_error, cli_in_process, refused_in_process
from tests.leftovers import nothing_left_behind
from xsa_lm.errors import UserError
from xsa_lm.scale.fit import (
    choose_form,
    fit_loss_vs_compute,
    fit_shared,
    huber_scale,
    lack_of_fit_variance,
    ladder_bootstrap,
)
from xsa_lm.scale.report import BenchRatio, ScaleStudyResult, SizeResult, render_markdown, write_report
from xsa_lm.scale.run import LadderAnalysis, analyse, keep_sizes, reanalyse, size_tests
from xsa_lm.stats.paired import holm
from xsa_lm.sweep.trials import Launcher

E, A, ALPHA = 2.0, 50.0, 0.15  # a synthetic SA curve L(C) = E + A C^-alpha
COMPUTE = np.array([1e12, 4e12, 1.6e13, 6.4e13, 2.56e14])


def sa_curve(compute):
    return E + A * np.asarray(compute) ** -ALPHA


def test_the_fit_recovers_known_parameters_from_noisy_points():
    rng = np.random.default_rng(0)
    fit = fit_loss_vs_compute(COMPUTE, sa_curve(COMPUTE) + rng.normal(0, 0.002, len(COMPUTE)))
    assert fit.form == "power_law_offset"
    assert fit.E == pytest.approx(E, abs=0.1)
    assert fit.alpha == pytest.approx(ALPHA, rel=0.15)
    assert max(abs(r) for r in fit.residuals) < 0.006  # about the noise, 3 sd
    exact = fit_loss_vs_compute(COMPUTE, sa_curve(COMPUTE))
    assert (exact.E, exact.A * exact.c_ref**exact.alpha, exact.alpha) == pytest.approx((E, A, ALPHA), rel=1e-3)
    assert exact.as_dict()["A"] == pytest.approx(A, rel=1e-3)


def test_a_fit_with_fewer_points_than_parameters_is_refused():
    assert choose_form(4) == "power_law_offset" and choose_form(3) == "power_law" and choose_form(2) == "power_law"
    with pytest.raises(UserError, match="has 3 parameters but only 2 size"):
        choose_form(2, "power_law_offset")
    with pytest.raises(UserError, match="has 2 parameters but only 1 size"):
        fit_loss_vs_compute([1e12], [3.0])
    pure = fit_loss_vs_compute(COMPUTE[:3], 7.0 * COMPUTE[:3] ** -0.05)  # a pure power law is recovered exactly
    assert pure.form == "power_law" and pure.E == 0 and pure.alpha == pytest.approx(0.05, rel=1e-4)


def test_the_fit_inverts_to_compute_and_the_shared_fit_recovers_a_known_compute_ratio():
    fit = fit_loss_vs_compute(COMPUTE, sa_curve(COMPUTE))
    assert fit.compute_for(fit.loss(1e13)) == pytest.approx(1e13)
    assert fit.compute_for(fit.E - 0.1) == math.inf  # below the floor: no compute reaches it
    shared = fit_shared(COMPUTE, sa_curve(COMPUTE), sa_curve(1.2 * COMPUTE), offset=True)  # XSA = SA at 1.2x
    assert shared.multiplier == pytest.approx(1.2, rel=1e-3)
    assert (shared.E, shared.alpha) == pytest.approx((E, ALPHA), rel=1e-3)


K_TRUE = 1.2  # the simulated XSA is SA with 1.2x the compute


def curved_sa(compute):
    """A truth not of the fitted form: a second, faster-decaying term."""
    return sa_curve(compute) + 0.3 * (np.asarray(compute) / 1e12) ** -0.5


def simulated_study(rng, deviation: float, seeds: int = 4, noise: float = 0.004):
    """4 sizes; each size off the curve by a deviation both arms share plus half as much of each arm's own."""
    shared = rng.normal(0, deviation, 4)

    def arm(k: float) -> list:  # the arm with k x the compute
        noisy = (curved_sa(k * c) + d + rng.normal(0, deviation / 2) for c, d in zip(COMPUTE[:4], shared, strict=True))
        return [loss + rng.normal(0, noise, seeds) for loss in noisy]

    return COMPUTE[:4], arm(1.0), arm(K_TRUE)


def ladder_interval(compute, sa, xsa, resamples: int):
    """k's bootstrap interval; sa[i][s], xsa[i][s]: the loss of seed s at size i."""
    means_sa, means_xsa = [s.mean() for s in sa], [x.mean() for x in xsa]
    se = [runs.std(ddof=1) / math.sqrt(len(runs)) for runs in [*sa, *xsa]]
    f_scale = huber_scale(means_sa + means_xsa, se)
    fit = fit_shared(compute, means_sa, means_xsa, offset=True, f_scale=f_scale)
    lof = lack_of_fit_variance(fit.residuals, se, fit.parameters)
    runs = np.array(sa), np.array(xsa)
    return ladder_bootstrap(fit, compute, *runs, lof_variance=lof, f_scale=f_scale, n_resamples=resamples)


def test_the_ladder_bootstrap_resamples_seeds_with_both_arms_runs_together():
    """Each seed's noise is the same in both arms (XSA is SA at 1.2x the compute, seed by seed): resampling seeds
    moves both arms' means alike and k hardly at all; drawn apart (XSA's seeds shuffled), the interval is wide."""
    rng = np.random.default_rng(1)
    compute = COMPUTE[:4]
    noise = rng.normal(0, 0.02, (4, 6))  # size, seed
    sa, xsa = sa_curve(compute)[:, None] + noise, sa_curve(K_TRUE * compute)[:, None] + noise
    fit = fit_shared(compute, sa.mean(axis=1), xsa.mean(axis=1), offset=True, f_scale=0.003)  # the same means apart
    interval = lambda xsa: ladder_bootstrap(fit, compute, sa, xsa, lof_variance=0.0, f_scale=0.003, n_resamples=40)
    lo, hi = interval(xsa)
    apart_lo, apart_hi = interval(np.array([row[rng.permutation(6)] for row in xsa]))
    assert lo <= K_TRUE <= hi and (hi - lo) < 0.2 * (apart_hi - apart_lo), (lo, hi, apart_lo, apart_hi)


@pytest.mark.slow
@pytest.mark.long
def test_the_ladder_interval_covers_k_on_deviating_misspecified_ladders():
    """100 simulated studies (4 sizes, 4 seeds, size-level deviations of 0.02 nats, a truth with a second power
    term the fit lacks): the bootstrap interval holds the true k in 85-99% of them."""
    rng = np.random.default_rng(0)
    covered = 0
    for _ in range(100):
        compute, sa, xsa = simulated_study(rng, deviation=0.02)
        lo, hi = ladder_interval(compute, sa, xsa, resamples=60)
        covered += lo <= K_TRUE <= hi
    assert 85 <= covered <= 99, covered


def clean_sizes(
    compute=COMPUTE[:4], sa_means=None, xsa_means=None, lr_grid=(1e-3, 2e-3, 4e-3), selected_lr=2e-3, warnings=()
) -> list[SizeResult]:
    """A study's sizes as size_result saves them, 4 seeds of noise (sd 0.002) drawn around the given means."""
    rng = np.random.default_rng(3)
    sa_means = sa_curve(compute) if sa_means is None else sa_means
    xsa_means = sa_curve(K_TRUE * np.asarray(compute)) if xsa_means is None else xsa_means
    sizes = []
    for i, (c, m_sa, m_xsa) in enumerate(zip(compute, sa_means, xsa_means, strict=True)):
        sa, xsa = (m + rng.normal(0, 0.002, 4) for m in (m_sa, m_xsa))
        sizes.append(
            SizeResult(
                model=f"m{i}",
                compute=float(c),
                non_embedding_params=10**6 * 4**i,
                selected_lr=selected_lr,
                lr_grid=list(lr_grid),
                seeds=[1, 2, 3, 4],
                sa_runs=[float(v) for v in sa],
                xsa_runs=[float(v) for v in xsa],
                sa_mean=float(sa.mean()),
                xsa_mean=float(xsa.mean()),
                sweep_warnings=list(warnings),
                sa_tokens_per_s=100.0,
                xsa_tokens_per_s=98.0,
                sweep_returncode=0,
            )
        )
    return sizes


def flags_of(sizes: list[SizeResult]) -> list[str]:
    """The flags read the fits, not the bootstrap: a few resamples will do."""
    return [f["flag"] for f in analyse(sizes, "auto", resamples=10, seed=0).fit["flags"]]


def study_results(sizes: list[SizeResult], analysis: LadderAnalysis, tmp_path: Path) -> ScaleStudyResult:
    models = [s.model for s in sizes]
    return ScaleStudyResult(
        study_dir=str(tmp_path), study_id="toy-study", overrides=[], models=models, **vars(analysis)
    )


def test_a_clean_ladder_raises_no_flag_and_recovers_k_within_its_interval(tmp_path: Path):
    sizes = clean_sizes()
    bench = BenchRatio(
        source="bench.json", model=None, xsa_over_sa_step_time={"median": 1.05, "interval": [1.02, 1.08]}
    )
    analysis = analyse(sizes, "auto", resamples=200, seed=0, bench=bench)
    fit = analysis.fit
    assert fit["flags"] == [] and "not_results" not in fit
    lo, hi = fit["multiplier_ci"]
    assert lo <= K_TRUE <= hi and lo <= fit["multiplier"] <= hi and 1 < lo
    assert fit["multiplier"] == pytest.approx(K_TRUE, rel=0.05)
    assert fit["wallclock"]["multiplier"] == pytest.approx(fit["multiplier"] / 1.05)
    assert fit["wallclock"]["ci"] == pytest.approx([lo / 1.08, hi / 1.02])
    report = render_markdown(study_results(sizes, analysis, tmp_path))
    assert f"k = **{fit['multiplier']:.3f}**" in report and "wall-clock k: " in report
    unbenched = analyse(sizes, "auto", resamples=100, seed=0).fit["wallclock"]  # not from the trials' throughput
    assert unbenched == {"multiplier": None, "ci": None, "note": "wall-clock k: measure throughput with xsa-lm bench"}


def bumped(means, at: int, by: float):
    out = np.array(means, dtype=float)
    out[at] += by
    return out


FLAG_LADDERS = {  # each flag, and a ladder made to trip it (its name before a space)
    "lack_of_fit": lambda: clean_sizes(sa_means=bumped(sa_curve(COMPUTE[:4]), 1, 0.03)),
    "extrapolation": lambda: clean_sizes(xsa_means=sa_curve(1000 * COMPUTE[:4])),
    "compute_span": lambda: clean_sizes(compute=np.array([1e12, 1.6e12, 2.6e12, 4.1e12])),
    "parameter_at_bound": lambda: clean_sizes(
        sa_means=50 * COMPUTE[:4] ** -0.15, xsa_means=50 * (1.2 * COMPUTE[:4]) ** -0.15
    ),
    "xsa_flat_or_not_monotone": lambda: clean_sizes(xsa_means=bumped(sa_curve(1.2 * COMPUTE[:4]), 3, 0.1)),
    "sa_not_monotone": lambda: clean_sizes(sa_means=bumped(sa_curve(COMPUTE[:4]), 1, 0.2)),
    "lr_at_grid_edge": lambda: clean_sizes(selected_lr=4e-3),
    "lr_at_grid_edge from the sweep's warning, no grid saved": lambda: clean_sizes(
        lr_grid=(), warnings=["the best LR 0.002 is the highest LR of the grid: the optimum may lie above it"]
    ),
}


@pytest.mark.parametrize("name", FLAG_LADDERS)
def test_each_flag_fires_on_a_ladder_made_to_trip_it(name: str):
    assert name.split()[0] in flags_of(FLAG_LADDERS[name]())


def test_two_sizes_leave_no_degree_of_freedom_and_are_flagged():
    fit = analyse(clean_sizes()[:2], "auto", resamples=100, seed=0).fit
    reasons = {f["flag"]: f["reason"] for f in fit["flags"]}
    assert fit["lack_of_fit"]["dof"] == 0 and "no lack-of-fit test possible" in reasons["lack_of_fit"]
    assert "multiplier" not in fit and fit["not_results"]["why"] == [f["flag"] for f in fit["flags"]]


def test_the_toy_study_reanalysed_prints_no_multiplier(tmp_path: Path):
    saved = json.loads((Path(__file__).parent / "data" / "scale_toy_results.json").read_text())
    results = reanalyse(saved, resamples=100, when="2026-01-01")
    fit = results.fit
    flags = {f["flag"]: f["reason"] for f in fit["flags"]}
    assert {"lack_of_fit", "extrapolation", "compute_span", "sa_not_monotone", "lr_at_grid_edge"} <= set(flags)
    assert fit["lack_of_fit"]["dof"] == 1 and fit["lack_of_fit"]["chi2"] == pytest.approx(50.1, abs=0.1)
    assert fit["lack_of_fit"]["p"] < 1e-10 and "chi^2 = 50.1 on 1 dof" in flags["lack_of_fit"]
    assert "multiplier" not in fit and "multiplier_ci" not in fit and "wallclock" not in fit
    hidden = fit["not_results"]
    assert hidden["why"] == list(flags) and hidden["multiplier"] > 1
    for size, raw in zip(results.sizes, saved["sizes"], strict=True):
        assert size.sa_runs == raw["sa_runs"] and size.xsa_runs == raw["xsa_runs"]  # the raw data kept
        kept = set(size.to_json())
        assert not {"multiplier", "multiplier_ci", "multiplier_ci_bootstrap", "wallclock_multiplier"} & kept
    report = write_report(results, tmp_path)
    for value in (hidden["multiplier"], *hidden["ci"]):
        for digits in (3, 4):
            assert f"{value:.{digits}f}" not in report
    assert not re.search(r"\bk = [\d*]", report) and not re.search(r"wall-clock k: [\d*]", report)
    assert_golden("scale_toy_reanalysed.md", report)
    assert (tmp_path / "multiplier.png").exists()


def test_each_size_gets_the_paired_tests_holm_across_sizes_and_one_pooled_sign_test():
    sa = [5.21, 4.81, 5.11, 4.95, 5.02]
    xsa = [4.73, 4.80, 4.68, 4.99, 4.70]
    given = [
        SizeResult(model="a", compute=1.0, sa_runs=sa, xsa_runs=xsa),
        SizeResult(model="b", compute=2.0, sa_runs=[1.0, 1.0], xsa_runs=[0.9, 1.0]),
        SizeResult(model="c", sa_runs=[1.0], xsa_runs=[0.5], error="no summary"),  # left out of the fit: no test
    ]
    sizes, across = size_tests(given)
    assert all(size.tests is None for size in given)  # the sizes given are left as they were
    tests = sizes[0].tests
    assert tests is not None
    assert tests["wilcoxon_p"] == pytest.approx(scipy.stats.wilcoxon(np.subtract(xsa, sa), method="exact").pvalue)
    assert tests["sign_p"] == pytest.approx(scipy.stats.binomtest(4, 5, 0.5).pvalue)
    assert tests["t_p"] == pytest.approx(scipy.stats.ttest_rel(xsa, sa).pvalue)
    assert tests["xsa_lower"] == 4 and sizes[2].tests is None
    p_values = [s.tests["t_p"] for s in sizes[:2] if s.tests]
    assert [s.tests["t_p_holm"] for s in sizes[:2] if s.tests] == holm(p_values)
    pooled = across["pooled_sign"]
    assert (pooled["pairs"], pooled["xsa_lower"]) == (7, 5)  # the tie of the second size counts in no sign test
    assert pooled["p"] == pytest.approx(scipy.stats.binomtest(5, 6).pvalue)


STUDY = """experiment=scale_toy scale.models=[tiny_d32,tiny_d64] scale.seeds=[1,2,3] sweep.lrs=[3e-3]
launcher.max_parallel=2 scale.bootstrap_resamples=200 tokenizer.vocab_size=512 trainer.max_steps=6 val_every_steps=3
scheduler.warmup_steps=2 global_batch_tokens=1024 micro_batch_size=8 model.block_size=64 data.val_windows=16
logger=csv""".split()


AXES = {"size": STUDY, "tokens": ["experiment=tokens_toy"]}  # a study of each axis, right until one setting is wrong
# Each setting a study takes, wrong: refused in one line before the study directory exists or any size's sweep or run
# starts. The last ones of each axis are refused by every size's sweep or runs, checked as they will check them
# (trials included, each composed as its `xsa-lm train` will compose it).
REFUSALS = {
    "size": [
        ("model=tiny", "model=tiny: model is set by xsa-lm scale for each size; set the sizes with scale.models"),
        ("model.d_model=64", "model.d_model=64: model.d_model is set by xsa-lm scale for each size; each size's model"),
        ("scale.models=[tiny]", "scale.models needs at least two distinct model presets"),
        ("scale.models=[tiny,nosuch]", "has no model preset nosuch; available: gpt2_124m, paper_0.7b, "),
        ("scale.axis=depth", "scale.axis=depth must be one of size, tokens"),
        ("scale.fit=cubic", "scale.fit=cubic must be one of auto, power_law_offset, power_law"),
        ("scale.bootstrap_resamples=5", "scale.bootstrap_resamples=5 must be >= 100"),
        ("scale.bootstrap_seed=-1", "scale.bootstrap_seed=-1 must be >= 0"),
        ("scale.seeds=3", "scale.seeds=3 must be a list of distinct integers from 0 to 4294967295, or null"),
        ("scale.seeds=[a]", "scale.seeds=['a'] must be a list of distinct integers"),
        ("scale.seeds=[0,4]", "scale.seeds=[0,4] contains the search seed(s) [0] (sweep.search_seeds)"),
        ("scale.seeds=[]", "scale.seeds=[]: the study compares SA and XSA at every size, which needs compare seeds"),
        (f"scale.bench={Path(__file__)}", "no XSA/SA step time in it"),
        ("+scale.seed=1", "scale.seed: not an option"),
        ("sweep.diverge_above=0", "sweep.diverge_above=0 must be > 0"),
        ("launcher.max_parallel=0", "launcher.max_parallel=0 must be >= 1"),
        ("attention.layers=[5]", "scale has no key attention.layers"),  # an arm's options: in its option file
        ("global_batch_tokens=1000", "global_batch_tokens=1000 is not divisible"),
    ],
    "tokens": [
        ("scale.sa_budgets=[1]", "scale.sa_budgets needs 2+ positive budgets including 1"),
        ("scale.sa_budgets=1", "scale.sa_budgets=1 must be a list of positive numbers, e.g. [0.5,1,2]"),
        ("scale.xsa_budgets=[4]", "scale.xsa_budgets must lie within SA's budgets [0.5, 2]"),
        ("scale.warmup_fraction=1", "scale.warmup_fraction=1 must be < 1"),
        ("scale.tokens_per_param=0", "scale.tokens_per_param=0 must be > 0"),
        ("scale.measure_throughput=true scale.bench_rounds=2", "scale.bench_rounds=2 must be >= 6"),
        (
            "trainer.max_steps=100",
            "trainer.max_steps=100: trainer.max_steps is set by scale.axis=tokens; each run's steps",
        ),
        ("scale.seeds=[1,2]", "scale.seeds=[1,2] contains the search seed(s) [1] (sweep.search_seeds)"),
        ("scale.seeds=[2]", "needs 2+ compare seeds"),
        ("sweep.null_arm=[init,placebo]", "sweep.null_arm=placebo: scale.axis=tokens reads the init null's k"),
        ("sweep.search_seeds=[-1]", "sweep.search_seeds=[-1] must be a non-empty list of distinct integers from 0 to"),
        ("launcher.timeout_min=0", "launcher.timeout_min=0 must be >= 1"),
        ("sweep.lr_grids.tiny_l3_d48=[0]", "has tiny_l3_d48: [0], which must be a list of positive numbers"),
        ("attention.layers=[3]", "scale has no key attention.layers"),
        ("scale.tokens_per_param=0.000001", "budgets [0.5, 1.0, 2.0] B train [0, 0, 0] steps"),
        ("scale.tokens_per_param=1 scale.sa_budgets=[0.5,0.51,1,2]", "train [10, 10, 20, 41] steps"),
    ],
}
CASES = [(axis, override, message) for axis, rows in REFUSALS.items() for override, message in rows]


@pytest.mark.parametrize(("axis", "override", "message"), CASES, ids=[f"{a}:{o}" for a, o, _ in CASES])
def test_a_bad_setting_is_refused_in_one_line_before_the_study_folder_or_a_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    caches: list[Path],
    axis,
    override,
    message,
):
    """The study folder, the working folder and the caches are as they were: not even the folder Hydra made."""

    def started(*args, **kwargs) -> None:
        raise AssertionError("a size's sweep or a run started: the refusal came too late")

    monkeypatch.setattr("xsa_lm.sweep.run.run_sweep", started)
    monkeypatch.setattr(Launcher, "_start", started)
    study_dir = tmp_path / "study"
    args = ["scale", *AXES[axis], *override.split(), f"hydra.run.dir={study_dir}"]
    monkeypatch.chdir(tmp_path)
    with nothing_left_behind(tmp_path):
        lines = refused_in_process(args, monkeypatch, capsys).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xsa-lm: error: ") and message in lines[0], lines


def test_the_sizes_run_smallest_first_in_the_order_listed_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    def size_axis(*args, jobs: dict, **kwargs) -> list[str]:
        raise UserError(f"sizes {list(jobs)}")  # stops the study before any size runs

    monkeypatch.setattr("xsa_lm.scale.run.run_size_axis", size_axis)
    monkeypatch.setattr("xsa_lm.sweep.run.check_sweep", lambda *size: size)  # its checks have their own tests
    args = ["scale", *STUDY, "scale.models=[tiny,tiny_d32]", f"hydra.run.dir={tmp_path / 'study'}"]
    assert "sizes ['tiny_d32', 'tiny']" in refused_in_process(args, monkeypatch, capsys)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def test_a_rerun_may_add_sizes_but_not_leave_one_out(tmp_path: Path) -> None:
    state = tmp_path / "scale.json"
    state.write_text(json.dumps({"study_id": "s", "overrides": []}))  # a study that recorded no sizes yet
    keep_sizes(state, ["tiny_d32", "tiny_d64"])
    keep_sizes(state, ["tiny_d32", "tiny_d64", "tiny_d96"])
    assert json.loads(state.read_text())["models"] == ["tiny_d32", "tiny_d64", "tiny_d96"]
    with pytest.raises(UserError, match=r"leaves out \['tiny_d64'\]: give every size it has run"):
        keep_sizes(state, ["tiny_d32", "tiny_d96"])


@pytest.mark.slow
@pytest.mark.long
def test_scale_end_to_end_killed_and_resumed(
    tmp_path: Path, data_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    """Two sizes, one LR, three seeds: SIGKILL in the second size; the same command finishes, reusing done trials."""
    study = tmp_path / "study"
    args = [sys.executable, "-m", "xsa_lm.cli", "scale", *STUDY, f"hydra.run.dir={study}"]
    env = cli_env(data_cache)
    first = subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    second_size = study / "sizes" / "tiny_d64" / "trials"
    wait_for(lambda: second_size.exists() and any(second_size.iterdir()), 400, "the second size's first trial")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()

    # The second size's trial jobs (submitit's controllers and their tasks) are in the study's process group: gone
    # with it once no run's lock is held (a killed run leaves its lock file, unheld).
    def held(lock: Path) -> bool:
        with open(lock) as file:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False

    trial_locks = lambda: [p for p in (study / "sizes" / "tiny_d64" / "runs").glob("*/.xsa-lm.lock") if held(p)]  # noqa: E731
    wait_for(lambda: not trial_locks(), 60, "the killed trials to stop")
    finished_before = {p.name for p in (study / "sizes" / "tiny_d32" / "runs").iterdir()}

    proc = run_cli(["scale", *STUDY, f"hydra.run.dir={study}"], data_cache, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "already completed (reused)" in proc.stdout
    assert {p.name for p in (study / "sizes" / "tiny_d32" / "runs").iterdir()} == finished_before  # nothing rerun

    results = json.loads((study / "results.json").read_text())
    assert [s["model"] for s in results["sizes"]] == ["tiny_d32", "tiny_d64"]
    for size in results["sizes"]:
        assert {"model", "non_embedding_params", "selected_lr", "sa_mean", "xsa_mean", "tests", "lr_grid"} <= set(size)
        assert size["selected_lr"] == 3e-3 and size["seeds"] == [1, 2, 3] and size["lr_grid"] == [3e-3]
    # Two sizes leave the fit no degree of freedom and one LR is no search: flagged, so no multiplier is reported.
    flags = [f["flag"] for f in results["fit"]["flags"]]
    assert "lack_of_fit" in flags and "lr_at_grid_edge" in flags
    assert "multiplier" not in results["fit"] and results["fit"]["not_results"]["why"] == flags
    small, large = results["sizes"]
    assert small["non_embedding_params"] < large["non_embedding_params"]
    assert results["fit"]["form"] == "power_law" and results["fit"]["points"] == 2
    sweep = json.loads((study / "sizes" / "tiny_d64" / "results.json").read_text())
    assert all("run_dir" in t for t in sweep["trials"])  # each size is an ordinary sweep
    report = re.sub(" +", " ", (study / "report.md").read_text())  # the tables' padding aside
    assert "Not reported: the ladder is flagged" in report and "| tiny_d64 |" in report
    # A rerun that swaps a size it has run for another would rewrite the report without it: refused, nothing touched.
    swapped = [a if not a.startswith("scale.models=") else "scale.models=[tiny_d32,tiny_d96]" for a in STUDY]
    before = (study / "results.json").read_bytes()
    refused = run_cli(["scale", *swapped, f"hydra.run.dir={study}"], data_cache, tmp_path, timeout=120)
    assert_clean_error(refused, "scale.models=['tiny_d32', 'tiny_d96'] leaves out ['tiny_d64']")
    assert (study / "results.json").read_bytes() == before and not (study / "sizes" / "tiny_d96").exists()
    # So would another fit, chosen after seeing this one: the plan holds it.
    state = (study / "scale.json").read_bytes()
    refit = cli_in_process(
        ["scale", *STUDY, "scale.fit=power_law_offset", f"hydra.run.dir={study}"],
        data_cache,
        tmp_path,
        monkeypatch,
        capsys,
    )
    assert_clean_error(refit, "planned with other settings (fit 'auto' -> 'power_law_offset')")
    assert (study / "results.json").read_bytes() == before and (study / "scale.json").read_bytes() == state
    assert "Not reported: the ladder is flagged" in proc.stdout  # the terminal shows the report
    assert (study / "loss_vs_compute.png").stat().st_size > 10_000 and (study / "multiplier.png").exists()


def test_the_report_run_logs_the_sizes_table_and_both_plots_to_the_study_group(tmp_path: Path, monkeypatch):
    """The analysis and the W&B report run on a synthetic study (offline W&B, read back from its run file)."""
    from tests.wandb_records import history, run_files, run_record, summary
    from xsa_lm.reporting import ReportRunSettings
    from xsa_lm.scale.report import log_to_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    sizes = clean_sizes()
    analysis = analyse(sizes, "auto", resamples=100, seed=0)
    assert analysis.fit["form"] == "power_law_offset" and analysis.warnings == []
    results = study_results(sizes, analysis, tmp_path)
    assert re.search(r"^\| +m3 +\|", write_report(results, tmp_path), re.M)
    log_to_wandb(results, tmp_path, ReportRunSettings(mode="offline"))
    (run_file,) = run_files(tmp_path)
    assert (run_record(run_file).run_group, run_record(run_file).job_type) == ("toy-study", "scale-report")
    assert summary(run_file)["fit"] == analysis.fit["formula"]
    assert summary(run_file)["multiplier"] == pytest.approx(analysis.fit["multiplier"])
    logged = {key for row in history(run_file) for key in row}
    for name in ("scale/sizes", "scale/loss_vs_compute", "scale/multiplier"):
        assert any(key.startswith(name) for key in logged), (name, sorted(logged))


def test_the_scale_study_under_results_is_read_and_reported() -> None:
    """results/scale_toy/results.json as `xsa-lm scale` reads it again, and its report from this renderer."""
    results = ScaleStudyResult.read(Path(__file__).parents[1] / "results" / "scale_toy" / "results.json")
    assert_golden("scale_scale_toy.md", render_markdown(results))
