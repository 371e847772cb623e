"""The paper's protocol: grid, selection, statistics, trial outcomes, and whole sweeps through `xsa-lm sweep`."""

import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest
import scipy.stats
import submitit
from hydra import compose, initialize_config_module

from tests.golden import assert_golden
from tests.helpers import (
    FAST,
    assert_refused,
    cli_env,
    cli_in_process,
    compose_train,
    refused_in_process,
    run_cli,
    write_local_task,
)
from tests.leftovers import nothing_left_behind
from tests.wandb_records import config, history, run_files, run_record, summary
from xsa_lm.config.spec import TrainSpec, parse
from xsa_lm.errors import UserError
from xsa_lm.eval.run import resolve_tasks, task_file_digests
from xsa_lm.files import write_json
from xsa_lm.stats.decision import VERDICTS
from xsa_lm.stats.paired import paired_t
from xsa_lm.sweep import jobs, protocol
from xsa_lm.sweep import run as sweep_run
from xsa_lm.sweep.protocol import SequentialRule, Trial, check_seeds, compare_trials, search_trials, select_lr
from xsa_lm.sweep.report import SweepResult, build_results, render_markdown
from xsa_lm.sweep.run import (
    REPORTED,
    check_sweep,
    comparison_plan,
    downstream_evaluation,
    keep_plan,
    train_overrides,
)
from xsa_lm.sweep.settings import LauncherSpec, ScaleSpec, StallRule, SweepSpec
from xsa_lm.sweep.trials import RETRY_DAMAGED, Launcher, TrialRecord, TrialStore, gpu_slots, outcome
from xsa_lm.train.runinfo import code_version
from xsa_lm.train.summary import RunSummary

# FAST without the keys the sweep sets for each trial (optim.lr, progress_bar).
SWEEP_FAST = [o for o in FAST if not o.startswith(("optim.lr=", "progress_bar="))]


# --- the grid and the selection -------------------------------------------------------------------------------


def test_lr_grid_from_a_list_or_a_log_range(tmp_path: Path) -> None:
    assert protocol.lr_grid([3e-3, 1e-3, 3e-3], None) == [1e-3, 3e-3]
    assert protocol.lr_grid(None, {"min": 1e-4, "max": 1e-2, "num": 3}) == pytest.approx([1e-4, 1e-3, 1e-2])
    assert protocol.lr_grid(None, {"min": 1e-4, "max": 1e-3, "num": 2}) == [1e-4, 1e-3]
    assert protocol.lr_grid(None, None, preset=[3e-3, 1e-3]) == [1e-3, 3e-3]
    with pytest.raises(UserError, match="needs an LR grid"):
        protocol.lr_grid(None, None)
    assert protocol.lr_grid([3e-2, 3.01e-2], None) == [3e-2, 3.01e-2]  # lr0.03 and lr0.0301
    store = TrialStore(tmp_path / "sweep")  # an earlier grid's run of the same name
    store.save(TrialRecord.missing(Trial("sa", 3.004e-2, 0), "search"))
    assert store.load(Trial("sa", 3.004e-2, 0)) is not None
    with pytest.raises(UserError, match="records sa_lr0.03_s0 at LR 0.03004, and this sweep asks for LR 0.03"):
        store.is_final(Trial("sa", 3e-2, 0))


C, D, F = "completed", "diverged", ("failed", None)


def ok(*losses: float) -> list[tuple[str, float]]:
    return [(C, loss) for loss in losses]


MAJORITY = [(D, None), (C, 2.0), (D, 50.0)]  # 50 is above the bound: diverged too; 2.0 never wins
# name: (search runs by LR as (status, final val loss) per seed, (the LR selected, some LRs' medians (None: not
# usable, a diverged run counting as +inf), what each warning says))
SELECTIONS = {
    "inside the grid": ({1e-4: ok(3.2), 3e-4: ok(3.0), 1e-3: ok(3.1)}, (3e-4, {}, [])),
    "a tie": (
        {1e-4: ok(3.5), 3e-4: ok(2.9, 3.0, 3.3), 1e-3: ok(3.0, 2.8, 3.1), 3e-3: ok(3.4)},
        (3e-4, {3e-4: 3.0, 1e-3: 3.0}, []),
    ),
    "diverged never wins": ({1e-4: ok(3.3), 3e-4: ok(3.1), 1e-3: [(D, 0.5)], 3e-3: [(D, 12.0)]}, (3e-4, {}, [])),
    "NaN never wins": ({1e-4: ok(3.3), 3e-4: ok(math.nan), 1e-3: ok(3.4)}, (1e-4, {3e-4: None}, ["lowest LR"])),
    "nothing usable": ({1e-3: [(D, None)], 1e-2: ok(math.inf)}, (None, {1e-3: None}, ["no LR is usable"])),
    "lowest LR": ({1e-4: ok(3.0), 3e-4: ok(3.5), 1e-3: ok(3.5)}, (1e-4, {}, ["lowest LR of the grid"])),
    "highest LR": ({1e-4: ok(3.5), 3e-4: ok(3.5), 1e-3: ok(3.0)}, (1e-3, {}, ["extend the grid above"])),
    "one LR": ({3e-4: ok(3.0)}, (3e-4, {}, ["holds one LR (0.0003): nothing was searched"])),
    "a stalled seed": (
        {3e-4: ok(3.30, 3.32, 3.31), 1e-3: ok(3.10, 4.50, 3.12), 3e-3: ok(3.4)},
        (1e-3, {3e-4: 3.31, 1e-3: 3.12}, []),
    ),
    "even seeds": ({1e-3: ok(3.3), 3e-3: ok(3.0, 3.2)}, (3e-3, {3e-3: 3.1}, ["above"])),
    "diverged minority": (
        {1e-3: MAJORITY, 3e-3: [(C, 3.0), (D, None), (C, 3.2)]},
        (3e-3, {1e-3: None, 3e-3: 3.2}, ["above"]),
    ),
    "diverged half": (
        {1e-3: MAJORITY, 3e-3: [(C, 3.0), (D, None)]},
        (None, {3e-3: None}, ["half the search runs or more"]),
    ),
    "failed and missing runs are left out": (
        {1e-4: ok(3.3), 3e-4: [(C, 3.0), F, (None, None), (C, 3.4)], 1e-3: ok(3.3), 3e-3: [F]},
        (3e-4, {3e-4: 3.2, 3e-3: None}, ["LR 0.0003, 0.003 did not finish (failed or interrupted): the selection"]),
    ),
}


@pytest.mark.parametrize(("results", "expected"), SELECTIONS.values(), ids=SELECTIONS)
def test_the_selection_takes_the_lowest_median_loss_and_says_what_to_check(results, expected) -> None:
    (lr, medians, warnings), selection = expected, select_lr(results)
    assert selection.lr == lr and len(selection.warnings) == len(warnings), selection.warnings
    assert all(said in warning for said, warning in zip(warnings, selection.warnings, strict=True))
    assert {at: selection.losses[at] for at in medians} == pytest.approx(medians)


def test_compare_phase_never_reuses_the_winning_search_run_by_default() -> None:
    # The search's SA run at the selected LR won partly on its noise (the winner's curse): by default the compare
    # seeds must not contain a search seed, so no compare trial is a search trial.
    grid = [1e-4, 3e-4, 1e-3]
    search = search_trials(grid, [0, 5], ["sa", "xsa"])
    assert len(search) == 12 and {t.seed for t in search} == {0, 5}  # every LR x every search seed x each arm
    for lr in grid:
        assert not set(compare_trials(lr, check_seeds([1, 2], search_seeds=[0, 5]), ["sa", "xsa"])) & set(search)
    assert check_seeds([3], search_seeds=[7]) == [3]  # the refusals: the next test
    # Opting in: the search's SA run at that LR and seed is the same trial (same id), reused.
    trials = compare_trials(3e-4, check_seeds([0, 1], search_seeds=[0], reuse_search_run=True), ["sa", "xsa"])
    assert Trial("sa", 3e-4, 0) in trials and Trial("sa", 3e-4, 0).id == "sa_lr0.0003_s0"
    assert check_seeds([], search_seeds=[0, 1]) == [] and check_seeds(None, search_seeds=[0]) == []  # search only


@pytest.mark.parametrize(
    ("seeds", "search_seeds"), [([0, 1], [0]), ([1, 2, 3, 4], [2, 4, 5]), ([3, 0, 7], [7, 8, 0]), ([6], [6, 7])]
)
def test_a_compare_seed_among_the_search_seeds_is_refused_with_a_disjoint_replacement(
    seeds: list[int], search_seeds: list[int]
) -> None:
    with pytest.raises(UserError) as refused:
        check_seeds(seeds, search_seeds=search_seeds)
    message = str(refused.value)
    assert "\n" not in message and message.endswith("or set sweep.reuse_search_run=true to accept the bias")
    shared = [s for s in seeds if s in search_seeds]
    assert f"contains the search seed(s) [{','.join(map(str, shared))}] (sweep.search_seeds)" in message
    suggested = json.loads(message.split("e.g. sweep.seeds=")[1].split(")")[0])
    assert len(suggested) == len(seeds) == len(set(suggested))  # as many seeds, distinct
    assert not set(suggested) & set(search_seeds)  # none of them a search seed
    assert [s for s in suggested if s in seeds] == [s for s in seeds if s not in search_seeds]  # the others kept
    assert check_seeds(suggested, search_seeds=search_seeds) == suggested  # the suggestion passes


# --- the results record and its report (golden files: tests/golden/) --------------------------------------------


def _record(phase: str, attention: str, lr: float, seed: int, value: float | str, **more) -> TrialRecord:
    """A trial record: a float is a completed run's final val loss, a str the status of a run without one."""
    completed = isinstance(value, float)
    return TrialRecord(
        id=f"{attention}_lr{lr:g}_s{seed}",
        phase=phase,
        attention=attention,
        lr=lr,
        seed=seed,
        status="completed" if completed else str(value),
        final_val_loss=value if completed else None,
        **more,
    )


def _compare(seed: int, sa: float | str, xsa: float | str, lr: float = 3e-4) -> list[TrialRecord]:
    return [_record("compare", "sa", lr, seed, sa), _record("compare", "xsa", lr, seed, xsa)]


def _search(lrs_losses: dict[float, float], seed: int = 0) -> list[TrialRecord]:
    return [_record("search", "sa", lr, seed, loss) for lr, loss in lrs_losses.items()]


SEARCH = {1e-4: 3.2, 3e-4: 3.0, 1e-3: 3.1}
GRID = sorted(SEARCH)
SELECTION = select_lr({lr: [("completed", loss)] for lr, loss in SEARCH.items()})


def _results(trials: list[TrialRecord], selection=SELECTION, *, grid=GRID, **options) -> SweepResult:
    """build_results of a sweep "s" without training overrides or XSA tuning."""
    options = {"seeds": [1, 2], "search_seeds": [0]} | options
    return build_results(
        Path("sweep"),
        sweep_id="s",
        grid=grid,
        train_overrides=[],
        trials=trials,
        arms=["sa", "xsa"],
        selection=selection,
        **options,
    )


def test_the_comparison_is_a_record_of_its_tests_and_its_verdict(tmp_path: Path) -> None:
    trials = _search(SEARCH) + [r for seed in range(1, 6) for r in _compare(seed, 3.0 + seed / 10, 2.9)]
    results = _results(trials, seeds=[1, 2, 3, 4, 5], margin=0.01)
    compare = results.comparison
    assert results.search_seeds == [0] and results.reuse_search_run is False and results.warnings == []
    assert results.stalls is None and results.sequential is None  # one search seed: no stall table
    assert compare.seeds == [1, 2, 3, 4, 5] and compare.xsa_better_in == 5 and compare.significance == "xsa lower"
    assert compare.wilcoxon_p_value == pytest.approx(0.0625) and compare.sign_test_p_value == pytest.approx(0.0625)
    assert compare.margin is not None and compare.margin.verdict == "better"
    assert SweepResult.from_json(json.loads(json.dumps(results.to_json()))) == results  # results.json reads back
    assert_golden("sweep_compare.md", render_markdown(results))


@pytest.mark.parametrize(
    ("diffs", "significance"),
    [
        ([], "no pairs"),
        ([-0.1], "one seed"),
        ([-0.1, -0.1], "no spread"),
        ([-0.1, -0.12, -0.11], "xsa lower"),
        ([0.1, 0.12, 0.11], "xsa higher"),
        ([-0.1, 0.1, 0.01], "not significant"),
    ],
)
def test_what_the_interval_decides_is_a_field_of_the_comparison(diffs: list[float], significance: str) -> None:
    trials = [r for seed, d in enumerate(diffs, start=1) for r in _compare(seed, 3.0, 3.0 + d)]
    assert _results(trials, seeds=list(range(1, len(diffs) + 1))).comparison.significance == significance


def test_reusing_the_search_run_warns_that_the_comparison_is_biased(tmp_path: Path) -> None:
    trials = _search(SEARCH) + _compare(0, 3.0, 3.02) + _compare(1, 3.05, 3.00)
    trials[-4] = replace(trials[-4], reused=True)  # the SA run at seed 0 is the search's winner
    results = _results(trials, seeds=[0, 1])
    assert results.reuse_search_run is True
    assert len(results.warnings) == 1 and "biased against XSA" in results.warnings[0]
    assert_golden("sweep_reused.md", render_markdown(results))


def test_dropped_seeds_and_a_one_point_grid_are_warned(tmp_path: Path) -> None:
    trials = _search({3e-4: 3.0}) + _compare(1, 3.0, 2.9) + _compare(2, 3.1, 3.05)
    trials += _compare(3, 3.2, "diverged") + _compare(4, "failed", 3.0) + _compare(5, "missing", "missing")
    selection = select_lr({3e-4: [("completed", 3.0)]})
    results = _results(trials, selection, grid=[3e-4], seeds=[1, 2, 3, 4, 5])
    compare = results.comparison
    assert compare.seeds == [1, 2] and compare.xsa_better_in == 2  # the dropped seeds count nowhere
    assert [d["seed"] for d in compare.dropped_seeds] == [3, 4, 5]
    one_lr, *dropped = results.warnings
    assert "holds one LR (0.0003)" in one_lr  # select_lr's
    assert len(dropped) == 3 and all("is left out of the mean, the confidence interval" in w for w in dropped)
    assert "seed 3" in dropped[0] and "XSA diverged" in dropped[0] and "a result in itself" in dropped[0]
    assert "seed 4" in dropped[1] and "SA failed" in dropped[1] and "retry" in dropped[1]
    assert "seed 5" in dropped[2] and "SA did not run and XSA did not run" in dropped[2]
    assert_golden("sweep_dropped.md", render_markdown(results))


def _seeded_search(attention: str, lr: float, seed: int, final: float | str, at_40: float | None = None):
    """A search record with a validation history over 100 steps: a float is a completed run's final val loss (its
    loss at 40% of the run is at_40, else the final loss + 0.5), a str the status of a run without one."""
    done = isinstance(final, float)
    history = [
        {"step": 40, "tokens": 40_000, "val_loss": at_40 if at_40 is not None else (final + 0.5 if done else 9.9)},
        {"step": 100, "tokens": 100_000, "val_loss": final if done else 9.9},
    ]
    return _record("search", attention, lr, seed, final, steps=100, val_history=history)


def test_a_search_only_sweep_shows_each_lrs_median_every_seed_and_the_stall_table(tmp_path: Path) -> None:
    trials = [
        _seeded_search("sa", 1e-3, 0, 3.10),
        _seeded_search("sa", 1e-3, 1, 3.20, at_40=4.0),  # far above its LR's median at 40%: a stall
        _seeded_search("sa", 3e-3, 0, 3.40),
        _seeded_search("sa", 3e-3, 1, "diverged"),
    ]
    runs: dict[float, list] = {}
    for t in trials:
        runs.setdefault(t.lr, []).append((t.status, t.final_val_loss))
    selection, grid = select_lr(runs), [1e-3, 3e-3]
    rule = StallRule(at_fraction=0.4, margin=0.15)
    results = _results(trials, selection, grid=grid, seeds=[], search_seeds=[0, 1], stall_rule=rule)
    assert (
        results.search["sa"]["0.001"].median == pytest.approx(3.15) and results.search["sa"]["0.001"].runs == trials[:2]
    )
    assert results.search["sa"]["0.003"].median is None  # half its seeds diverged: the median is +inf
    assert results.selected_lr == 1e-3 and results.compare_table == []
    assert results.stalls is not None and results.stalls.stalls == {"sa": 1, "xsa": 0}
    assert results.stalls.judged == {"sa": 3, "xsa": 0}
    assert_golden("sweep_stalls.md", render_markdown(results))
    one_seed = _results(trials[::2], selection, grid=grid, seeds=[], search_seeds=[0], stall_rule=rule)
    assert one_seed.stalls is None  # one search seed: a stall is not told from an unlucky LR
    assert _results(trials, selection, grid=grid, seeds=[], search_seeds=[0, 1]).stalls is None  # no rule


def test_the_sequential_rule_adds_its_record_and_its_section(tmp_path: Path) -> None:
    trials = _search(SEARCH) + _compare(1, 3.0, 2.95) + _compare(2, 3.1, 3.04) + _compare(3, 3.05, 3.0)
    rule = SequentialRule.plan(n_seeds=2, cap=5)
    looks = [rule.look(2, [-0.05, -0.06]), rule.look(3, [-0.05, -0.06, -0.05])]
    results = _results(trials, seeds=[1, 2, 3], sequential=rule.summary(looks, "significant"))
    plain = _results(trials, seeds=[1, 2, 3])
    assert replace(results, sequential=None) == plain  # the sequential rule only adds its own record
    assert results.sequential is not None and results.sequential.alpha_per_look == 0.0125
    assert_golden("sweep_sequential.md", render_markdown(results))
    capped = _results(trials, seeds=[1, 2, 3], sequential=rule.summary(looks, "cap"))
    assert "the cap was reached without the corrected CI excluding 0" in render_markdown(capped)
    cut_short = _results(trials[:-2], seeds=[1, 2], sequential=rule.summary([], "incomplete"))
    assert_golden("sweep_sequential_incomplete.md", render_markdown(cut_short))


def test_a_sweep_without_a_usable_lr_reports_that_the_comparison_did_not_run(tmp_path: Path) -> None:
    trials = [_record("search", "sa", lr, 0, "diverged") for lr in (1e-2, 1e-1)]
    selection = select_lr({1e-2: [("diverged", None)], 1e-1: [("diverged", None)]})
    results = _results(trials, selection, grid=[1e-2, 1e-1], seeds=[0])
    assert results.selected_lr is None and results.comparison.seeds == [] and "no LR is usable" in results.warnings[0]
    assert_golden("sweep_no_lr.md", render_markdown(results))


@pytest.mark.parametrize("study", ["demo_noise", "null_toy", "null_calibration", "stalls_toy"])
def test_the_sweeps_under_results_are_read_and_reported(study: str) -> None:
    """results/<study>/results.json as `xsa-lm sweep` reads it again, and its report from this renderer."""
    results = SweepResult.read(Path(__file__).parents[1] / "results" / study / "results.json")
    assert_golden(f"sweep_{study}.md", render_markdown(results))


def test_paper_sweep_picks_the_grid_of_the_model_preset() -> None:
    def grid(*overrides: str) -> list[float]:
        cfg = compose_train(list(overrides), config_name="sweep")
        grids = cfg.sweep.lr_grids
        return protocol.lr_grid(cfg.sweep.lrs, cfg.sweep.lr_range, grids.get(cfg.model.name, grids.get("default")))

    for preset, table_1_lr in (("paper_0.7b", 5e-4), ("paper_1.4b", 4e-4), ("paper_2.7b", 3e-4)):
        for chosen in (grid(f"experiment={preset}"), grid(f"model={preset}")):
            assert len(chosen) == 5 and chosen[2] == table_1_lr  # the paper's LR in the middle of the grid
            assert chosen[0] == pytest.approx(table_1_lr / 2, rel=0.01) and chosen[-1] == table_1_lr * 2
    assert grid("model=gpt2_124m") == [1e-4, 2e-4, 4e-4, 6e-4]  # any other model: the LR-robustness grid
    assert grid("experiment=paper_0.7b", "sweep.lrs=[1e-4,2e-4]") == [1e-4, 2e-4]  # an explicit grid wins
    assert grid("experiment=demo", "sweep=demo") == [3e-3, 1e-2, 3e-2]
    shipped = (["sweep=demo"], [], ["experiment=paper_lr_robustness_toy"], ["experiment=stalls_toy"])
    for overrides in shipped:  # the shipped seeds are valid, and the compare seeds disjoint from the search's
        sweep = compose_train(overrides, config_name="sweep").sweep
        search_seeds = list(sweep.search_seeds)
        assert not set(search_seeds) & set(check_seeds(sweep.seeds, search_seeds, sweep.reuse_search_run))


# --- sequential stopping (sweep.seeds_until_significant) --------------------------------------------------------


def test_sequential_seeds_continue_after_the_largest_and_skip_every_search_seed() -> None:
    seq = protocol.seed_sequence
    assert seq([1, 2], search_seeds=[0], cap=5) == [1, 2, 3, 4, 5]
    assert seq([1], search_seeds=[3], cap=4) == [1, 2, 4, 5]  # 3 is a search seed: its SA run may have won
    assert seq([5, 1], search_seeds=[0], cap=3) == [5, 1, 6]
    assert seq([1, 2, 3], search_seeds=[0], cap=3) == [1, 2, 3]
    assert seq([1, 2], search_seeds=[0, 3, 4, 6], cap=6) == [1, 2, 5, 7, 8, 9]  # every search seed skipped
    assert seq([10], search_seeds=[11, 12], cap=3) == [10, 13, 14]
    for cap in (1, 2, True, 2.5, None):  # below the 3 seeds of sweep.seeds (or two pairs), or not an integer
        with pytest.raises(UserError, match="sweep.seeds_until_significant must be an integer"):
            seq([1, 2, 3], search_seeds=[0], cap=cap)
    with pytest.raises(UserError, match=r"needs compare seeds to start from: set sweep.seeds=\[1,2\]"):
        seq([], search_seeds=[0], cap=4)  # a search-only sweep has nothing to continue


def test_sequential_rule_is_bonferroni_over_the_planned_looks() -> None:
    # Looks after each seed count from sweep.seeds (at least 2 pairs) to the cap, each at 5% / looks.
    rule = SequentialRule.plan(n_seeds=2, cap=6)
    assert (rule.first_look, rule.looks, rule.alpha_per_look) == (2, 5, pytest.approx(0.01))
    assert SequentialRule.plan(n_seeds=1, cap=4).looks == 3 and SequentialRule.plan(n_seeds=3, cap=6).looks == 4
    assert SequentialRule.plan(n_seeds=4, cap=4).alpha_per_look == pytest.approx(0.05)  # one look: no correction
    # Three pairs, mean -0.05, sd 0.01: the plain 95% CI excludes 0 (half-width 4.303 x 0.01 / sqrt 3 = 0.0248), the
    # corrected 99% one does not (t(0.995, 2) = 9.925 from printed tables: half-width 0.0573). Not a stop yet.
    diffs = [-0.05, -0.04, -0.06]
    assert paired_t(diffs).ci[1] < 0  # the plain 95% CI
    look = rule.look(3, diffs)
    assert look.ci == pytest.approx(
        (-0.05 - 9.9248 * 0.01 / math.sqrt(3), -0.05 + 9.9248 * 0.01 / math.sqrt(3)), abs=1e-5
    )
    assert not look.significant and rule.stopped(look) is None
    assert look.p_value == pytest.approx(paired_t(diffs).p) and look.pairs == 3
    strong = rule.look(4, [-0.05, -0.051, -0.049, -0.05])
    assert strong.significant and rule.stopped(strong) == "significant" and strong.ci[1] < 0
    at_cap = rule.look(6, [0.01, -0.02, 0.0, 0.03, -0.01])  # a diverged pair dropped: 5 pairs at 6 seeds
    assert not at_cap.significant and rule.stopped(at_cap) == "cap"
    assert rule.look(2, [0.1]).ci is None  # one usable pair: no CI, never significant
    summary = rule.summary([look, strong], "significant")
    assert summary.correction == "bonferroni" and summary.planned_looks == 5 and summary.n_looks == 2
    assert summary.seeds == 4 and summary.ci == strong.ci and summary.confidence == pytest.approx(0.99)


def test_the_correction_holds_the_false_positive_rate_that_repeated_looks_inflate() -> None:
    # Under no true difference, stopping at the first look whose CI excludes 0 declares a difference far more often
    # than 5% at the plain level; at the rule's corrected level it stays at most 5%.
    import numpy as np

    rng = np.random.default_rng(0)
    rule, sims = SequentialRule.plan(n_seeds=2, cap=10), 20000
    diffs = rng.normal(size=(sims, rule.cap))

    def false_positive_rate(alpha: float) -> float:
        rejected = np.zeros(sims, dtype=bool)
        for n in range(rule.first_look, rule.cap + 1):
            x = diffs[:, :n]
            t = x.mean(axis=1) / (x.std(axis=1, ddof=1) / math.sqrt(n))
            rejected |= np.abs(t) > scipy.stats.t.ppf(1 - alpha / 2, n - 1)
        return float(rejected.mean())

    assert false_positive_rate(rule.alpha) > 0.12  # nine plain looks: the 5% level does not hold
    assert false_positive_rate(rule.alpha_per_look) <= 0.05


# --- trial outcomes ------------------------------------------------------------------------------------------


def _summary(status: str = "completed", loss: float | None = 4.0) -> RunSummary:
    at = 7 if status == "diverged" else None
    rest = dict(attention="sa", model="tiny", lr=1e-3, seed=0, steps=10, tokens_seen=640, run_dir="run")
    return RunSummary(status=status, final_val_loss=loss, diverged_at_step=at, model_config={"vocab_size": 512}, **rest)


def test_outcome_of_trial_processes() -> None:
    assert outcome(0, _summary(), "", None).status == "completed"
    # ln(512) = 6.24: a final loss above a uniform guess counts as diverged; an explicit bound replaces it.
    high = outcome(0, _summary(loss=7.0), "", None)
    assert high.status == "diverged" and "6.238" in str(high.error)
    assert outcome(0, _summary(loss=5.0), "", diverge_above=4.5).status == "diverged"
    nan = outcome(0, _summary(status="diverged", loss=None), "", None)
    assert nan.status == "diverged" and "step 7" in str(nan.error)
    killed = outcome(-9, None, "", None)
    assert killed.status == "failed" and "SIGKILL" in str(killed.error)
    crashed = outcome(1, None, "xsa-lm: error: data.files matched nothing", None)
    assert (crashed.status, crashed.error) == ("failed", "xsa-lm: error: data.files matched nothing")
    assert outcome(1, _summary(), "RuntimeError: boom", None).status == "failed"


def test_parallel_trials_get_their_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert gpu_slots(2) == [[0, 1], [2, 3]] and gpu_slots(3) == [[0], [1], [2]]
    assert gpu_slots(1) == [[0, 1, 2, 3]]  # one trial: it sees every GPU (and may use DDP)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_slots(2) == [[], []]  # CPU: trials share the machine
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(UserError, match="max_parallel"):
        gpu_slots(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1a2b")
    with pytest.raises(UserError, match="by index"):
        gpu_slots(1)


def _spec(**settings) -> SweepSpec:  # the sweep's settings as configs/sweep/paper.yaml has them, but these
    return _paper_sweep().model_copy(update=settings)


@functools.cache
def _paper_sweep() -> SweepSpec:
    return parse(SweepSpec, compose_train([], config_name="sweep").sweep, at="sweep.")


def test_trials_at_once_share_the_cores_unless_the_threads_are_set(tmp_path: Path, monkeypatch) -> None:
    """Unless OMP_NUM_THREADS is set, local trials at once share the cores; SLURM gives each job its own."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    store = TrialStore(tmp_path / "sweep")

    def threads(**launch) -> int | None:
        return Launcher(store, [], _spec(), LauncherSpec(**{"kind": "local", **launch})).threads

    assert (threads(max_parallel=2), threads(max_parallel=3), threads(max_parallel=16)) == (4, 2, 1)
    assert threads(max_parallel=1) is None and threads(kind="slurm", max_parallel=2) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads(max_parallel=2) is None  # yours, kept


def test_a_reused_trial_is_judged_by_this_runs_divergence_bound(tmp_path: Path, capsys) -> None:
    """A rerun with another sweep.diverge_above judges its reused trials again; each change names the bound."""
    store, trial = TrialStore(tmp_path / "sweep"), Trial("sa", 1e-3, 0)
    store.run_dir(trial).mkdir(parents=True)
    write_json(store.run_dir(trial) / "summary.json", _summary(loss=5.0).to_json())
    store.save(replace(TrialRecord.missing(trial, "search"), status="completed", returncode=0, final_val_loss=5.0))
    Launcher(store, [], _spec(diverge_above=4.5)).run([trial], phase="search", job_type="search")
    diverged = cast(TrialRecord, store.load(trial))
    assert diverged.status == "diverged" and "above the divergence bound 4.500" in str(diverged.error)
    assert "diverged under this run's divergence bound 4.500 (sweep.diverge_above)" in capsys.readouterr().out
    Launcher(store, [], _spec()).run([trial], phase="search", job_type="search")  # the default bound, ln(512) = 6.24
    assert cast(TrialRecord, store.load(trial)).status == "completed"
    said = capsys.readouterr().out
    assert "completed under this run's divergence bound 6.238 (ln of the vocabulary size)" in said, said


def test_a_reused_trial_with_a_damaged_summary_says_how_to_write_it_again(tmp_path: Path) -> None:
    """The line names the resume that writes the file again, not the sweep that only reads it."""
    store, trial = TrialStore(tmp_path / "sweep"), Trial("sa", 1e-3, 0)
    store.run_dir(trial).mkdir(parents=True)
    (store.run_dir(trial) / "summary.json").write_text(json.dumps(_summary(loss=5.0).to_json())[:100])
    store.save(replace(TrialRecord.missing(trial, "search"), status="completed", returncode=0, final_val_loss=5.0))
    expected = f"write it again with `xsa-lm train hydra.run.dir={store.run_dir(trial)} resume=auto`, then the sweep"
    with pytest.raises(UserError, match=re.escape(expected) + "$"):
        Launcher(store, [], _spec()).run([trial], phase="search", job_type="search")


def test_a_damaged_trial_record_says_how_to_retry_and_the_retry_keeps_the_runs_result(tmp_path: Path, monkeypatch):
    """Moved aside as the line says, the trial runs again; its complete run's earlier summary.json is its result."""
    store, trial = TrialStore(tmp_path / "sweep"), Trial("sa", 1e-3, 0)
    (store.run_dir(trial) / "checkpoints").mkdir(parents=True)
    (store.run_dir(trial) / "checkpoints" / "last.ckpt").write_bytes(b"")  # the sweep resumes, keeping the folder
    summary_file = store.run_dir(trial) / "summary.json"
    write_json(summary_file, _summary(loss=5.0).to_json())
    os.utime(summary_file, (0, 0))  # written by an earlier attempt
    record = store.records / f"{trial.id}.json"
    record.parent.mkdir(parents=True)
    record.write_text("{garbage")
    monkeypatch.setattr(jobs, "executor", lambda launch, folder, name, gpus: submitit.DebugExecutor(folder))
    monkeypatch.setattr(jobs, "train_in_process", lambda args: 0)  # as the finished run: nothing left to train
    launcher = Launcher(store, [], _spec())
    with pytest.raises(UserError, match=re.escape(RETRY_DAMAGED) + "$"):
        launcher.run([trial], phase="search", job_type="search")
    record.unlink()
    launcher.run([trial], phase="search", job_type="search")
    retried = cast(TrialRecord, store.load(trial))
    assert (retried.status, retried.final_val_loss) == ("completed", 5.0)


def test_training_overrides_pass_through_and_sweep_keys_stay() -> None:
    given = ["model=tiny", "trainer.max_steps=10", "sweep.lrs=[1e-3]", "sweep=demo", "+foo=1", "launcher=slurm"]
    kept = train_overrides([*given, "launcher.partition=gpu"])
    assert kept == ["model=tiny", "trainer.max_steps=10", "+foo=1"]


def _plan(
    search_seeds: tuple = (0,), seeds: tuple = (1, 2), cap: int | None = 4, margin: float = 0.15, **reported
) -> dict:
    """comparison_plan of configs/sweep/paper.yaml's sweep whose stall rule has this margin, as sweep.json keeps it."""
    stall = {"at_fraction": 0.4, "margin": margin, "loss_threshold": None}
    planned = {"search_seeds": list(search_seeds), "seeds_until_significant": cap, "stall": stall, "margin": 0.01}
    return comparison_plan(_spec(**planned, **reported), list(seeds))


def test_the_plan_is_recorded_at_the_first_run_and_a_rerun_cannot_change_it(tmp_path: Path) -> None:
    state_file = tmp_path / "sweep.json"
    state_file.write_text(json.dumps({"sweep_id": "s", "train_overrides": []}))  # as open_sweep writes it
    keep_plan(state_file, _plan(), [1e-3])  # what each run of the sweep does
    first = json.loads(state_file.read_text())
    stall = {"at_fraction": 0.4, "margin": 0.15, "loss_threshold": None}
    seeds = {"search_seeds": [0], "seeds": [1, 2], "seeds_until_significant": 4}
    statistics = {"alpha": 0.05, "planned_looks": 3, "stall": stall, "margin": 0.01}  # 3 looks
    assert first["plan"] == seeds | statistics | REPORTED  # the paper's settings are those an older plan had
    assert first["sweep_id"] == "s" and [h["grid"] for h in first["history"]] == [[1e-3]]
    keep_plan(state_file, _plan(), [1e-3, 3e-3])  # the same plan, a larger grid: allowed, its history kept
    assert [h["grid"] for h in json.loads(state_file.read_text())["history"]] == [[1e-3], [1e-3, 3e-3]]
    kept = state_file.read_bytes()
    for changed, named in (
        (_plan(seeds=(1, 3)), "seeds [1, 2] -> [1, 3]"),
        (_plan(seeds=(1, 2, 3)), "seeds [1, 2] -> [1, 2, 3], planned_looks 3 -> 2"),
        (_plan(cap=6), "seeds_until_significant 4 -> 6, planned_looks 3 -> 5"),
        (_plan(cap=None), "seeds_until_significant 4 -> None, planned_looks 3 -> 1"),
        (_plan(search_seeds=(0, 5)), "search_seeds [0] -> [0, 5]"),
        (_plan(margin=0.1), f"stall {stall!r} -> { ({**stall, 'margin': 0.1})!r}"),
        (_plan(null_arm=["init"]), "null_arm [] -> ['init']"),  # the report gains a null section
        (_plan(null_arm=["placebo"]), "null_arm [] -> ['placebo']"),
        (_plan(placebo_scale=1e-5), "placebo_scale 1e-06 -> 1e-05"),
        (_plan(candidates=["xsa", "gated"]), "candidates ['xsa'] -> ['xsa', 'gated']"),
        (_plan(tune_xsa=True), "tune_xsa False -> True"),
        (_plan(diverge_above=5.0), "diverge_above None -> 5.0"),
        (_plan(eval_tasks="paper"), "eval_tasks None -> 'paper'"),
    ):
        with pytest.raises(UserError) as refused:
            keep_plan(state_file, changed, [1e-3, 3e-3])
        message = str(refused.value)
        assert "\n" not in message and f"({named})" in message, message
        assert "rewrites its report" in message and "a new hydra.run.dir" in message
        assert state_file.read_bytes() == kept  # nothing recorded
    with pytest.raises(UserError, match=r"\(seeds \[1, 2\] -> \[2, 1\]\)"):  # sequential: one pair at a time, in order
        keep_plan(state_file, _plan(seeds=(2, 1)), [1e-3])
    fixed = tmp_path / "fixed" / "sweep.json"
    fixed.parent.mkdir()
    keep_plan(fixed, _plan(seeds=(1, 2, 3), cap=None), [1e-3])
    keep_plan(fixed, _plan(seeds=(3, 1, 2), cap=None), [1e-3])  # a fixed set of seeds, in another order: the same plan
    assert json.loads(fixed.read_text())["plan"]["seeds"] == [1, 2, 3]  # as first planned
    with pytest.raises(UserError, match=r"\(seeds \[1, 2, 3\] -> \[3, 1\]"):
        keep_plan(fixed, _plan(seeds=(3, 1), cap=None), [1e-3])


def test_a_plan_recorded_before_a_key_reads_it_as_the_default_it_had(tmp_path: Path) -> None:
    state_file = tmp_path / "sweep.json"
    older = {k: v for k, v in _plan().items() if k not in REPORTED}
    state_file.write_text(json.dumps({"sweep_id": "s", "train_overrides": [], "plan": older}))
    keep_plan(state_file, _plan(), [1e-3])  # the same sweep, rerun: resumed
    with pytest.raises(UserError, match=r"\(null_arm \[\] -> \['init'\]\)"):
        keep_plan(state_file, _plan(null_arm=["init"]), [1e-3])
    for recorded, arms in ((False, []), (True, ["init"])):  # a plan from before the placebo: its null is the init null
        state = {"sweep_id": "s", "train_overrides": [], "plan": older | {"null_arm": recorded}}
        state_file.write_text(json.dumps(state))
        keep_plan(state_file, _plan(null_arm=arms), [1e-3])
        with pytest.raises(UserError, match=r"null_arm"):
            keep_plan(state_file, _plan(null_arm=["init", "placebo"]), [1e-3])
    sizes = tmp_path / "scale.json"  # a size-axis study's plan: no seeds of its own (each size's sweep has them)
    sizes.write_text(json.dumps({"study_id": "s", "overrides": [], "plan": {"bootstrap_seed": 0}}))
    keep_plan(sizes, {"bootstrap_seed": 0, "fit": "auto"}, [], earlier={"fit": "auto"})
    with pytest.raises(UserError, match=r"\(fit 'auto' -> 'power_law'\)"):
        keep_plan(sizes, {"bootstrap_seed": 0, "fit": "power_law"}, [], earlier={"fit": "auto"})


def _completed_compare(store: TrialStore, lr: float, seeds: list[int]) -> list[Trial]:
    """Completed compare records of SA and XSA at lr, as the compare phase leaves them."""
    trials = compare_trials(lr, seeds, ["sa", "xsa"])
    for trial in trials:
        store.save(replace(TrialRecord.missing(trial, "compare"), status="completed", final_val_loss=3.0))
    return trials


def test_a_comparison_at_an_earlier_grids_lr_is_reported_not_dropped(tmp_path: Path) -> None:
    """A rerun whose larger grid selects another LR warns of the comparison the folder ran at the earlier one."""
    store, earlier = TrialStore(tmp_path / "sweep"), sweep_run.earlier_comparisons
    _completed_compare(store, 1e-2, [1, 2])
    store.save(replace(TrialRecord.missing(Trial("sa", 1e-2, 0), "search"), status="completed"))  # not a comparison
    _completed_compare(store, 3e-2, [1, 2])
    assert earlier(store, 1e-2, ["sa", "xsa"])[0].startswith("this sweep folder already compared SA and XSA at LR 0.03")
    (warning,) = earlier(store, 3e-2, ["sa", "xsa"])
    runs = "sa_lr0.01_s1, sa_lr0.01_s2, xsa_lr0.01_s1, xsa_lr0.01_s2"
    assert f"at LR 0.01 (4 completed compare run(s): {runs};" in warning
    assert f"runs in {store.runs}) before this run's grid selected LR 0.03" in warning
    assert "the verdict shown was reached after that comparison was seen" in warning
    assert earlier(TrialStore(tmp_path / "other"), 3e-2, ["sa", "xsa"]) == []


def _fake_eval(calls: list[list[str]], returncode: int = 0):
    """subprocess.run standing in for `xsa-lm eval`: it refuses a folder that holds an eval.json, as eval does."""

    def run(cmd: list[str], stdout, stderr) -> subprocess.CompletedProcess:
        calls.append(cmd)
        args = dict(a.split("=", 1) for a in cmd if "=" in a)
        out = Path(args["hydra.run.dir"])
        if returncode or (out / "eval.json").exists():
            stdout.write("xsa-lm: error: the evaluation failed\n")
            return subprocess.CompletedProcess(cmd, 1)
        rows = [{"checkpoint": c} for c in args["ckpts"].strip("[]").split(",")]
        limit = float(args["limit"]) if "limit" in args else None
        tasks = args["tasks"].strip("[]").split(",")
        names = resolve_tasks(tasks)[0]
        write_json(
            out / "eval.json", {"tasks": names, "limit": limit, "rows": rows, "task_files": task_file_digests(tasks)}
        )
        return subprocess.CompletedProcess(cmd, 0)

    return run


def test_downstream_evaluation_is_reused_for_the_same_inputs_and_a_failure_fails_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another limit, other tasks or other checkpoints evaluate anew; the earlier eval folder is kept beside."""
    sweep_dir = tmp_path / "sweep"
    store, calls = TrialStore(sweep_dir), []
    monkeypatch.setattr(subprocess, "run", _fake_eval(calls))
    compare = _completed_compare(store, 1e-2, [1])

    def evaluate(tasks: list[str], limit: float | None, trials: list[Trial]) -> sweep_run.Evaluation:
        return downstream_evaluation(tasks, limit, store, trials, sweep_dir, baseline="sa")

    first = evaluate(["piqa"], 10, compare)
    assert first.result is not None and first.result["limit"] == 10 and first.warnings == []
    assert evaluate(["piqa"], 10, compare) == first and len(calls) == 1  # the same evaluation: reused
    full = evaluate(["piqa"], None, compare)
    assert len(calls) == 2 and full.error is None and cast(dict, full.result)["limit"] is None
    assert json.loads((sweep_dir / "eval.earlier1" / "eval.json").read_text())["limit"] == 10
    (warning,) = full.warnings
    assert "(2 checkpoints, tasks ['piqa'], limit 10.0)" in warning and f"kept in {sweep_dir}/eval.earlier1" in warning
    assert evaluate(["piqa", "arc_easy"], None, compare).result is not None and len(calls) == 3
    moved = evaluate(["piqa", "arc_easy"], None, _completed_compare(store, 3e-2, [1]))  # another selected LR
    assert moved.error is None and "lr0.03" in cast(dict, moved.result)["rows"][0]["checkpoint"]
    kept = ["eval", "eval.earlier1", "eval.earlier2", "eval.earlier3"]
    assert sorted(p.name for p in sweep_dir.glob("eval*")) == kept
    task_file = tmp_path / "mine.yaml"
    task_file.write_text("task: mine\ndataset_path: json\n")
    assert evaluate([str(task_file)], None, compare).result is not None and len(calls) == 5
    assert evaluate([str(task_file)], None, compare).warnings == [] and len(calls) == 5  # reused
    task_file.write_text("task: mine\ndataset_path: csv\n")  # the same task name, another task
    (edited,) = evaluate([str(task_file)], None, compare).warnings
    assert len(calls) == 6 and "other checkpoints, tasks, task files or limit" in edited
    monkeypatch.setattr(subprocess, "run", _fake_eval([], returncode=1))  # a failed evaluation fails the sweep
    failed = evaluate(["piqa"], None, compare)
    assert failed.result is None and failed.warnings[-1] == failed.error
    assert "downstream evaluation failed: xsa-lm: error: the evaluation failed" in str(failed.error)
    search = [_record("search", "sa", 1e-2, 0, 3.0)]
    done = _results(search, select_lr({1e-2: [("completed", 3.0)]}), grid=[1e-2], seeds=[])
    results = replace(done, eval_error=failed.error)
    assert str(sweep_run.sweep_problem(results)).endswith("(see logs/eval.log): run the same command again to retry it")
    assert sweep_run.sweep_problem(done) is None


# --- whole sweeps --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_sweep_end_to_end(tmp_path: Path, data_cache: Path) -> None:
    """Two LRs (one diverges), two seeds, XSA tuned, both null arms: the whole protocol, the report, W&B records."""
    sweep_dir = tmp_path / "sweep"
    with_wandb = [o for o in SWEEP_FAST if o != "logger=csv"]
    args = ["sweep", *with_wandb, "trainer.max_steps=20", "val_every_steps=10", "sweep.lrs=[3e-3,1e3]"]
    args += ["sweep.seeds=[1,2]", "sweep.tune_xsa=true", "sweep.null_arm=[init,placebo]"]
    args += ["launcher.max_parallel=2", f"hydra.run.dir={sweep_dir}"]
    proc = run_cli(args, data_cache, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((sweep_dir / "results.json").read_text())
    assert results["selected_lr"] == 3e-3
    by_key = {(t["phase"], t["attention"], t["lr"], t["seed"]): t for t in results["trials"]}
    assert by_key[("search", "sa", 1e3, 0)]["status"] == "diverged"  # lr 1000: NaN or a loss above ln(V)
    assert by_key[("search", "xsa", 1e3, 0)]["status"] == "diverged"
    for attention in ("sa", "xsa"):
        for seed in (1, 2):
            trial = by_key[("compare", attention, 3e-3, seed)]
            assert trial["status"] == "completed" and trial["final_val_loss"] < math.log(512)
            assert {"phase", "attention", "lr", "seed", "status", "final_val_loss", "run_dir"} <= set(trial)
            assert not trial["reused"]  # seeds disjoint from the search's: no compare run is a search run
    assert results["search_seeds"] == [0] and results["seeds"] == [1, 2] and not results["reuse_search_run"]
    assert len(list((sweep_dir / "runs").iterdir())) == 12  # 4 search + 4 compare + 2 null + 2 placebo runs
    null = [by_key[("null", "null", 3e-3, seed)] for seed in (1, 2)]  # SA from other weights, the same data
    assert all(t["status"] == "completed" for t in null) and "init_seed: 1000001" in Path(null[0]["config"]).read_text()
    placebo = [by_key[("placebo", "placebo", 3e-3, seed)] for seed in (1, 2)]  # SA from its own weights, perturbed
    assert all(t["status"] == "completed" for t in placebo)
    assert "init_perturbation: 1.0e-06" in Path(placebo[0]["config"]).read_text()
    sa = by_key[("compare", "sa", 3e-3, 1)]["final_val_loss"]
    assert abs(placebo[0]["final_val_loss"] - sa) < abs(null[0]["final_val_loss"] - sa)  # its pair shares more
    for arm in ("null", "placebo"):
        assert results[arm]["seeds"] == [1, 2] and results[arm]["margin"]["verdict"] in VERDICTS
    record = json.loads((sweep_dir / "trials" / "xsa_lr0.003_s1.json").read_text())
    assert record["executor"] == "local" and Path(record["log"]).parent == Path(record["job_folder"])  # a submitit job
    spans = sorted((t["started"], t["finished"]) for t in results["trials"] if t["phase"] == "search")
    overlaps = [b_start < a_end for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False)]
    assert any(overlaps), "launcher.max_parallel=2 ran the search trials one after another"
    compare = results["comparison"]
    assert compare["seeds"] == [1, 2] and compare["diff_ci95"] is not None and compare["diff_p_value"] is not None
    assert compare["min_detectable_diff"] == pytest.approx(
        (scipy.stats.t.ppf(0.975, 1) + scipy.stats.t.ppf(0.8, 1)) * compare["diff_std"] / math.sqrt(2)
    )
    assert compare["diff_mean"] == pytest.approx(sum(compare["xsa"]) / 2 - sum(compare["sa"]) / 2)
    assert any("lowest LR of the grid" in w for w in results["warnings"])
    assert results["xsa_tuning"]["selected_lr"] == 3e-3

    report = re.sub(" +", " ", (sweep_dir / "report.md").read_text())  # the tables' padding aside
    for text in (
        "## 1. LR search",
        "| 1000 |",
        "diverged",
        "## 2. SA vs XSA",
        "mean ± std",
        "95% CI",
        ", p = ",
        "## 3. XSA at its own best LR",
        "extend the grid",
        "seeds disjoint from the search's (seeds 0)",
        "this study could detect differences larger than",
        "### The nulls: SA against SA",
        "| init null - SA |",
        "| placebo - SA |",  # beside XSA - SA
        "Verdict against the plan's margin of 0.01 nats",
        "In bits per byte",
        "### XSA - SA along the window",
    ):
        assert text in report, text
    assert "## 2. SA vs XSA" in proc.stdout  # the report is printed at the end
    for plot in ("lr_sweep.png", "curves.png"):
        assert (sweep_dir / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # W&B: every trial in the sweep's group with its phase as job_type, final metrics in the run summary.
    (compare_run,), (search_run,) = (run_files(sweep_dir / "runs" / f"sa_lr0.003_s{s}") for s in (2, 0))
    record = run_record(compare_run)
    assert (record.run_group, record.job_type) == ("sweep", "compare")
    assert run_record(search_run).job_type == "lr-search"
    assert summary(search_run)["final_val_loss"] == pytest.approx(by_key[("search", "sa", 3e-3, 0)]["final_val_loss"])
    run_config = config(search_run)
    assert (run_config["attention"]["name"], run_config["optim"]["lr"], run_config["seed"]) == ("sa", 3e-3, 0)
    (report_run,) = run_files(sweep_dir)
    assert (run_record(report_run).run_group, run_record(report_run).job_type) == ("sweep", "report")
    assert summary(report_run)["selected_lr"] == 3e-3
    assert summary(report_run)["min_detectable_diff"] == pytest.approx(compare["min_detectable_diff"])
    placebo = json.loads((sweep_dir / "results.json").read_text())["placebo"]
    assert summary(report_run)["placebo/corr"] == pytest.approx(placebo["corr"])  # beside XSA's, as in the report
    assert summary(report_run)["diff_corr"] == pytest.approx(compare["corr"])
    assert summary(report_run)["code"] == str(code_version())
    logged = {key for row in history(report_run) for key in row}
    for name in ("report/trials", "report/lr_sweep", "report/curves"):  # media rows: report/lr_sweep/height, ...
        assert any(key.startswith(name) for key in logged), (name, sorted(logged))

    # The same command again: every trial is reused, nothing retrained, the results are the same.
    again = run_cli(args, data_cache, tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "started" not in again.stdout and again.stdout.count("(reused)") == 12  # the null runs too
    assert json.loads((sweep_dir / "results.json").read_text())["comparison"] == compare
    trained_by = json.loads((sweep_dir / "results.json").read_text())["code"]  # this code: reused without a word
    assert trained_by == [
        {"code": code_version().to_json(), "trials": sorted(t.name for t in (sweep_dir / "runs").iterdir())}
    ]
    assert f"- code: {code_version()} (all 12 finished runs)" in again.stdout  # the nulls included

    # Other training overrides in the same directory: refused, nothing touched.
    other = run_cli([*args, "trainer.max_steps=30"], data_cache, tmp_path, timeout=120)
    assert other.returncode == 2 and "same overrides" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.long
def test_sweep_adds_seeds_until_significant_or_the_cap(tmp_path: Path, data_cache: Path) -> None:
    """sweep.seeds_until_significant=3 from seed 1, search seed 2: seeds 1 and 3 (2 skipped), then 4 unless the first
    corrected look is significant; a rerun replays the looks on the reused trials and stops at the same place."""
    sweep_dir = tmp_path / "sweep"
    args = ["sweep", *SWEEP_FAST, "trainer.max_steps=10", "val_every_steps=10", "sweep.lrs=[3e-3]"]
    args += ["sweep.search_seeds=[2]", "sweep.seeds=[1]", "sweep.seeds_until_significant=3", "launcher.max_parallel=2"]
    args.append(f"hydra.run.dir={sweep_dir}")
    proc = run_cli(args, data_cache, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((sweep_dir / "results.json").read_text())
    sequential = results["sequential"]
    assert sequential["correction"] == "bonferroni" and sequential["planned_looks"] == 2
    assert sequential["alpha_per_look"] == pytest.approx(0.025)
    assert sequential["stopped"] in ("significant", "cap")
    ran = [1, 3] if sequential["stopped"] == "significant" and sequential["n_looks"] == 1 else [1, 3, 4]
    assert results["seeds"] == ran and sequential["seeds"] == len(ran)
    assert [look["seeds"] for look in sequential["looks"]] == list(range(2, len(ran) + 1))
    if sequential["stopped"] == "cap":
        assert not any(look["significant"] for look in sequential["looks"])
    compare = sorted((t["attention"], t["seed"]) for t in results["trials"] if t["phase"] == "compare")
    assert compare == sorted((a, s) for a in ("sa", "xsa") for s in ran)  # one pair per seed, the search seed skipped
    assert results["comparison"]["seeds"] == ran and results["comparison"]["diff_ci95"] is not None
    report = (sweep_dir / "report.md").read_text()
    assert "### Sequential stopping" in report and "Bonferroni-corrected level: 5% / 2 planned looks" in report
    assert "look 1 of at most 2: 2 seeds, 97.50% CI" in proc.stdout

    again = run_cli(args, data_cache, tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "started" not in again.stdout and again.stdout.count("(reused)") == 1 + 2 * len(ran)
    assert json.loads((sweep_dir / "results.json").read_text())["sequential"] == sequential


@pytest.mark.slow
@pytest.mark.long
def test_search_only_sweep_counts_stalls_and_a_rerun_cannot_change_the_plan(
    tmp_path: Path, data_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """sweep.seeds=[]: the LR x seed grid of SA and XSA is the study (two search seeds, one LR), the report counts
    stalls per arm with the attention diagnostics read from each run's metrics.csv; the same sweep with compare seeds
    added afterwards, or untuned, is refused in one line, its results untouched."""
    sweep_dir = tmp_path / "sweep"
    args = ["sweep", *SWEEP_FAST, "trainer.max_steps=10", "val_every_steps=5", "diagnostics.every_n_steps=5"]
    args += ["sweep.lrs=[3e-3]", "sweep.seeds=[]", "sweep.search_seeds=[0,1]", "sweep.tune_xsa=true"]
    args += ["launcher.max_parallel=2", f"hydra.run.dir={sweep_dir}"]
    proc = run_cli(args, data_cache, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((sweep_dir / "results.json").read_text())
    assert results["seeds"] == [] and results["search_seeds"] == [0, 1] and results["selected_lr"] == 3e-3
    assert {t["phase"] for t in results["trials"]} == {"search"} and len(results["trials"]) == 4
    assert results["comparison"]["seeds"] == [] and results["compare_table"] == []
    assert sorted(results["search"]) == ["sa", "xsa"] and len(results["search"]["xsa"]["0.003"]["runs"]) == 2
    stalls = results["stalls"]
    assert [(c["lr"], c["attention"], c["runs"]) for c in stalls["cells"]] == [(3e-3, "sa", 2), (3e-3, "xsa", 2)]
    assert stalls["judged"] == {"sa": 2, "xsa": 2} and stalls["rule"]["at_fraction"] == 0.4
    for row in stalls["runs"]:  # a_ii at step 5 (the first validation at 40% of 10 steps) from metrics.csv
        assert row["step"] == 5 and 0.0 <= row["diagnostics"]["a_ii"] <= 1.0, row
    report = re.sub(" +", " ", (sweep_dir / "report.md").read_text())  # the tables' padding aside
    assert "## Stalls per LR and arm" in report and "| 0.003 | SA | 2 |" in report and "| 0.003 | XSA | 2 |" in report
    assert "compare seeds none (search only)" in report and "Not run: a search-only sweep" in report
    assert len(list((sweep_dir / "runs").iterdir())) == 4
    plan = json.loads((sweep_dir / "sweep.json").read_text())["plan"]
    assert plan["seeds"] == [] and plan["search_seeds"] == [0, 1]

    before = {name: (sweep_dir / name).read_bytes() for name in ("results.json", "report.md", "sweep.json")}
    other_seeds = [a for a in args if a != "sweep.seeds=[]"] + ["sweep.seeds=[2,3]"]
    refused = cli_in_process(other_seeds, data_cache, tmp_path, monkeypatch, capsys)
    assert_refused(refused, "planned with other settings (seeds [] -> [2, 3])", "a new hydra.run.dir")
    untuned = [a for a in args if a != "sweep.tune_xsa=true"]  # the report would lose XSA's search
    refused = cli_in_process(untuned, data_cache, tmp_path, monkeypatch, capsys)
    assert_refused(refused, "planned with other settings (tune_xsa True -> False)")
    assert {name: (sweep_dir / name).read_bytes() for name in before} == before
    assert len(list((sweep_dir / "runs").iterdir())) == 4  # nothing trained


@pytest.mark.slow
@pytest.mark.long
def test_killed_sweep_resumes_without_rerunning_finished_trials(tmp_path: Path, data_cache: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    task = write_local_task(tmp_path / "tasks")  # the compare runs are also evaluated on a local harness task
    args = ["sweep", *SWEEP_FAST, "trainer.max_steps=60", "val_every_steps=10", "sweep.lrs=[1e-3,3e-3]"]
    args += ["sweep.seeds=[1]", f"sweep.eval_tasks=[{task}]", f"hydra.run.dir={sweep_dir}"]
    cmd = [sys.executable, "-m", "xsa_lm.cli", *args]
    out = open(tmp_path / "sweep.out", "w")  # closed after the kill
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(data_cache), stdout=out, stderr=subprocess.STDOUT)
    first, second = sweep_dir / "trials" / "sa_lr0.001_s0.json", sweep_dir / "trials" / "sa_lr0.003_s0.json"
    deadline = time.time() + 300
    while not (second.exists() and (sweep_dir / "runs" / "sa_lr0.003_s0" / "metrics.csv").exists()):
        assert proc.poll() is None and time.time() < deadline, "the sweep ended before its second trial started"
        time.sleep(0.2)
    proc.kill()  # SIGKILL: no handler runs; the trial's job runs on, and the rerun waits for it
    proc.wait()
    out.close()
    in_flight = json.loads(second.read_text())
    assert in_flight["status"] == "running" and in_flight["executor"] == "local"
    finished = json.loads(first.read_text())
    assert finished["status"] == "completed"
    finished_summary = (sweep_dir / "runs" / "sa_lr0.001_s0" / "summary.json").read_bytes()

    again = run_cli(args, data_cache, tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert "sa_lr0.001_s0 already completed (reused)" in again.stdout
    assert "sa_lr0.001_s0 started" not in again.stdout
    assert (sweep_dir / "runs" / "sa_lr0.001_s0" / "summary.json").read_bytes() == finished_summary
    assert f"sa_lr0.003_s0 re-attached to its local job {in_flight['job_id']}" in again.stdout
    waited = json.loads(second.read_text())  # the same job, not a second one
    assert (waited["status"], waited["attempt"], waited["job_id"]) == ("completed", 1, in_flight["job_id"])
    assert len(list((sweep_dir / "jobs" / "sa_lr0.003_s0").glob("*_submitted.pkl"))) == 1
    results = json.loads((sweep_dir / "results.json").read_text())
    assert {t["status"] for t in results["trials"]} == {"completed"}
    phases = {(t["phase"], t["attention"]) for t in results["trials"]}
    assert phases == {("search", "sa"), ("compare", "sa"), ("compare", "xsa")}
    assert [row["attention"] for row in results["eval"]["rows"]] == ["sa", "xsa"]
    assert "## 4. Downstream evaluation" in (sweep_dir / "report.md").read_text() and "| XSA - SA |" in again.stdout


@pytest.mark.long
@pytest.mark.slow
def test_sigterm_stops_the_trial_in_flight_and_records_it(tmp_path: Path, data_cache: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "xsa_lm.cli", "sweep", *SWEEP_FAST, "trainer.max_steps=200", "sweep.lrs=[1e-3]"]
    cmd += ["sweep.seeds=[1]", f"hydra.run.dir={sweep_dir}"]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=cli_env(data_cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    record_file = sweep_dir / "trials" / "sa_lr0.001_s0.json"
    deadline = time.time() + 120
    while not (sweep_dir / "runs" / "sa_lr0.001_s0" / "metrics.csv").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.2)
    pid = int(json.loads(record_file.read_text())["job_id"])  # the local job's controller
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


# Each setting a sweep takes, wrong: refused in one line before the sweep directory exists or any trial starts.
SWEEP_REFUSALS = [
    ("sweep.diverge_above=-1", "sweep.diverge_above=-1 must be > 0"),
    ("samples.prompt=Hi", "samples.prompt=Hi: samples.prompt acts only when samples.every_n_steps is set"),  # trials'
    ("sweep.margin=-0.1", "sweep.margin=-0.1 must be >= 0"),
    ("sweep.diverge_above=inf", "sweep.diverge_above=inf must be a finite number"),
    ("sweep.search_seeds=[-1]", "sweep.search_seeds=[-1] must be a non-empty list of distinct integers from 0 to"),
    ("sweep.search_seeds=[]", "sweep.search_seeds=[] must be a non-empty list of distinct integers from 0 to"),
    ("sweep.search_seeds=[0,0]", "sweep.search_seeds=[0, 0] must be a non-empty list of distinct integers"),
    ("sweep.lrs=[inf]", "sweep.lrs=[inf] must be a list of positive numbers"),
    ("sweep.seeds=[a,b]", "sweep.seeds=['a', 'b'] must be a list of distinct integers from 0 to 4294967295"),
    ("sweep.seeds=[4294967296]", "sweep.seeds=[4294967296] must be a list of distinct integers from 0 to"),
    ("sweep.seeds=[1,1]", "sweep.seeds=[1, 1] must be a list of distinct integers"),
    ("sweep.seeds=[0,1]", "contains the search seed(s) [0] (sweep.search_seeds)"),
    ("sweep.seeds_until_significant=2", "sweep.seeds_until_significant must be an integer of at least 2"),
    ("sweep.lrs=1e-3", "sweep.lrs=0.001 must be a list of positive numbers, e.g. [1e-3,3e-3], or null"),
    ("sweep.lrs=[1e-3,0.001]", "sweep.lrs=[0.001, 0.001] lists 0.001 twice"),
    ("sweep.lrs=[]", "needs an LR grid: sweep.lrs=[] is empty"),
    ("sweep.lrs=[1e-3] sweep.lr_range={min:1e-4,max:1e-2,num:3}", "sweep.lrs and sweep.lr_range are both set"),
    # Runs are named by 3 significant digits of their LR: two LRs of one name would share a run folder and record.
    ("sweep.lrs=[3e-2,1e-2,3.004e-2]", "the LR grid has 0.03 and 0.03004, which name one run (lr0.03"),
    (
        "sweep.lr_range={min:1e-3,max:1.01e-3,num:3}",
        "sweep.lr_range gives 0.001005 and 0.00101, which name one run (lr0.00101: runs are named by 3 significant "
        "digits): use LRs that differ within 3 significant digits, or fewer points",
    ),
    ("sweep.lr_range={min:1e-4,max:1e-2}", "must be {min:..,max:..,num:..} with 0 < min < max and an integer num"),
    ("sweep.lr_range={min:1e-2,max:1e-4,num:3}", "must be {min:..,max:..,num:..} with 0 < min < max"),
    ("sweep.lr_grids.tiny=[]", "has tiny: [], which must not be empty"),
    ("launcher.max_parallel=0", "launcher.max_parallel=0 must be >= 1"),
    ("launcher.max_parallel=null", "launcher=local needs a number of trials at once"),
    ("launcher=slurm launcher.mem_gb=-1", "launcher.mem_gb=-1 must be > 0"),
    ("launcher=slurm launcher.additional_parameters=exclusive", "launcher.additional_parameters=exclusive must be"),
    ("launcher.partition=gpu", "sweep has no key launcher.partition"),  # launcher=slurm's
    ("sweep.tune_xsa=yes", "sweep.tune_xsa=yes must be true or false"),
    ("sweep.stall.margin=-1", "sweep.stall needs 0 < at_fraction <= 1, margin >= 0"),
    ("sweep.eval_limit=0", "sweep.eval_limit=0 must be > 0"),
    ("sweep.eval_tasks=[nosuch]", "sweep.eval_tasks: unknown task(s) ['nosuch']: use lm-eval task names"),
    ("+sweep.lr=1e-3", "sweep.lr: not an option"),
    # A setting that cannot act here (a search-only sweep has no compare phase): refused, not ignored.
    ("sweep.null_arm=true sweep.seeds=[]", "sweep.null_arm=[init] would do nothing: it needs compare seeds"),
    ("sweep.null_arm=[init,init]", "sweep.null_arm=['init', 'init'] must be false, init, placebo or [init,placebo]"),
    ("init_perturbation=1e-3", "init_perturbation is set by the sweep for each trial; the sweep's placebo sets it"),
    ("sweep.candidates=[placebo]", "must not be placebo: the null arms' trials are named so"),
    ("sweep.eval_limit=10", "sweep.eval_limit=10 would do nothing: it needs tasks (sweep.eval_tasks)"),
    ("optim.lr=1e-3", "optim.lr is set by the sweep for each trial; set the grid with sweep.lrs"),
    (
        "attention=xsa",
        "attention is set by the sweep for each trial; the sweep trains each arm: choose them with sweep.baseline",
    ),
    ("seed=3", "seed is set by the sweep for each trial; set the seeds with sweep.search_seeds"),
    # Training keys, as each trial's `xsa-lm train` would refuse them: once, here, not in every trial.
    # An arm's options live in its option file (configs/attention/<arm>.yaml): the baseline's class takes no XSA's.
    ("attention.layers=[7]", "sweep has no key attention.layers"),
    ("global_batch_tokens=1000", "global_batch_tokens=1000 is not divisible"),
]


SLOW_REFUSALS = {"sweep.eval_tasks=[nosuch]"}  # lm-eval's task index is read: seconds, so not in make test-fast


@pytest.mark.parametrize(
    ("override", "message"),
    [pytest.param(o, m, id=o, marks=[pytest.mark.slow] if o in SLOW_REFUSALS else []) for o, m in SWEEP_REFUSALS],
)
def test_a_bad_setting_is_refused_in_one_line_before_the_sweep_folder_or_a_trial(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    caches: list[Path],
    override: str,
    message: str,
) -> None:
    """In its default folder: Hydra made outputs/sweep/<time> before the job's checks, and all three go again; the
    working folder and the caches are as they were."""
    monkeypatch.setattr(Launcher, "_start", lambda *_: pytest.fail("a trial started: the refusal came too late"))
    monkeypatch.chdir(tmp_path)
    with nothing_left_behind(tmp_path):
        stderr = refused_in_process(["sweep", *SWEEP_FAST, *override.split()], monkeypatch, capsys)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xsa-lm: error: ") and message in lines[0], stderr


def test_a_search_only_sweep_plans_the_baseline_search_alone() -> None:
    overrides = [*SWEEP_FAST, "sweep.lrs=[1e-3,3e-3]", "sweep.seeds=[]"]
    with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
        cfg = compose(config_name="sweep", overrides=overrides)
        job = check_sweep(parse(TrainSpec, cfg), parse(SweepSpec, cfg.sweep, at="sweep."), train_overrides(overrides))
    assert (job.grid, job.spec.search_seeds, job.seeds) == ([1e-3, 3e-3], [0], [])


def test_every_sweep_and_scale_setting_has_a_rule() -> None:
    """The rules cover the keys the configs have, no more (a new key without a rule fails here)."""
    for config_name in ("sweep", "scale"):
        cfg = compose_train([], config_name=config_name)
        parse(SweepSpec, cfg.sweep, at="sweep.")
    parse(ScaleSpec, cfg.scale, at="scale.")
    slurm = compose_train(["launcher=slurm"], config_name="sweep").launcher
    assert parse(LauncherSpec, slurm, at="launcher.").kind == "slurm" and set(slurm) == set(LauncherSpec.model_fields)
    assert set(cfg.launcher) < set(slurm)  # local's keys are slurm's
    assert set(cfg.sweep) == set(SweepSpec.model_fields) and set(cfg.scale) == set(ScaleSpec.model_fields)


def test_the_recorded_command_is_the_one_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """sweep.json's command reruns the sweep: it keeps the `sweep` word the CLI takes off for Hydra."""
    from xsa_lm.config.command_line import ARGV_VARIABLE

    monkeypatch.setenv(ARGV_VARIABLE, json.dumps(["xsa-lm", "sweep", "sweep=demo"]))
    monkeypatch.setattr(sys, "argv", ["xsa-lm", "sweep=demo"])  # what Hydra sees
    sweep_run.open_state(tmp_path / "sweep.json", [], None, id_key="sweep_id", overrides_key="o", holds="a sweep")
    assert json.loads((tmp_path / "sweep.json").read_text())["command"] == "xsa-lm sweep sweep=demo"
