"""`xsa-lm scale scale.axis=tokens`: the token-axis estimator on synthetic studies with known answers (k, its
Fieller interval, bounds, coverage, pooling), and the whole study end to end on two test-size models."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from tests.helpers import assert_clean_error, assert_nothing_written, compose_train, run_cli
from xsa_lm.scale.token_axis import bootstrap_interval, cell_estimate, ci_text, k_text, pool
from xsa_lm.scale.tokens import analyse_tokens

B = 1.0e6
BUDGETS = [B / 2, B, 2 * B]


def curve(tokens: float) -> float:
    """SA's loss, linear in ln tokens: 0.3 nats per e-fold."""
    return 6.0 - 0.3 * math.log(tokens / 1e5)


def study(rng: np.random.Generator, k: float, xsa_budget: float = B, seeds: int = 5, noise: float = 0.02):
    """Per-seed final losses: a shared seed effect (initialisation, data order) plus run noise; XSA is SA with k x
    the tokens."""
    seed_effect = rng.normal(0, 0.03, seeds)
    sa = [[curve(d) + seed_effect[s] + rng.normal(0, noise) for s in range(seeds)] for d in BUDGETS]
    xsa = [curve(k * xsa_budget) + seed_effect[s] + rng.normal(0, noise) for s in range(seeds)]
    return sa, xsa


def test_identical_curves_give_k_one():
    rng = np.random.default_rng(0)
    sa, _ = study(rng, k=1.0)
    cell = cell_estimate(sa, BUDGETS, sa[1], B)  # XSA = SA at B, seed by seed
    assert cell.k == pytest.approx(1.0, abs=1e-12) and cell.bound is None
    assert cell.ci[0] == pytest.approx(1.0) and cell.ci[1] == pytest.approx(1.0)


def test_a_known_multiplier_is_recovered_inside_its_interval_and_the_interval_is_fiellers():
    rng = np.random.default_rng(1)
    sa, xsa = study(rng, k=1.5, noise=0.005)
    cell = cell_estimate(sa, BUDGETS, xsa, B)
    assert cell.k == pytest.approx(1.5, rel=0.05)
    assert cell.ci[0] < 1.5 < cell.ci[1] and cell.ci[0] > 1.0  # resolved: XSA better
    # Fieller's closed form on the bracketing segment [B, 2B], computed independently
    a = np.array(sa[1]) - np.array(xsa)
    d = np.array(sa[1]) - np.array(sa[2])
    n = len(a)
    t = scipy.stats.t.ppf(0.975, n - 1)
    ma, md = a.mean(), d.mean()
    vaa, vdd = a.var(ddof=1) / n, d.var(ddof=1) / n
    vad = np.cov(a, d, ddof=1)[0, 1] / n
    root = math.sqrt((ma * md - t * t * vad) ** 2 - (md * md - t * t * vdd) * (ma * ma - t * t * vaa))
    theta = [
        (ma * md - t * t * vad - root) / (md * md - t * t * vdd),
        (ma * md - t * t * vad + root) / (md * md - t * t * vdd),
    ]
    fieller = [math.exp(math.log(B) + th * math.log(2)) / B for th in theta]
    assert cell.ci == pytest.approx(tuple(fieller), rel=1e-9)
    boot = bootstrap_interval(sa, BUDGETS, xsa, B)
    assert boot is not None and boot[0] < cell.k < boot[1]


def test_a_loss_beyond_sas_range_is_a_bound_not_a_number():
    rng = np.random.default_rng(2)
    sa, xsa = study(rng, k=6.0, noise=0.005)  # XSA at B reaches what SA reaches at 6B: beyond 2B
    cell = cell_estimate(sa, BUDGETS, xsa, B)
    assert cell.k is None and cell.bound == "k > 2" and cell.ln_k_se is None
    assert k_text(cell.as_dict()) == "k > 2"
    sa, xsa = study(rng, k=0.2, noise=0.005)  # worse than SA at B/2
    cell = cell_estimate(sa, BUDGETS, xsa, B)
    assert cell.k is None and cell.bound == "k < 0.5"
    assert ci_text(cell.as_dict()).startswith("[<= 0.5") or cell.ci[0] is None


def test_an_interval_that_reaches_sas_range_says_so():
    rng = np.random.default_rng(3)
    sa, xsa = study(rng, k=1.9, noise=0.05)  # near the top of the range, noisy: the upper end is unbounded
    cell = cell_estimate(sa, BUDGETS, xsa, B)
    assert cell.ci[1] is None
    assert ci_text(cell.as_dict()).endswith(">= 2]")


@pytest.mark.parametrize("k_true, xsa_budget", [(1.3, B), (1.6, B / 2), (1.0, B)])
def test_coverage_over_simulated_studies_with_five_seeds(k_true: float, xsa_budget: float):
    rng = np.random.default_rng(4)
    covered = 0
    trials = 400
    for _ in range(trials):
        sa, xsa = study(rng, k=k_true, xsa_budget=xsa_budget)
        cell = cell_estimate(sa, BUDGETS, xsa, xsa_budget)
        lo = cell.ci[0] if cell.ci[0] is not None else 0.0
        hi = cell.ci[1] if cell.ci[1] is not None else math.inf
        covered += lo <= k_true <= hi
    assert 0.90 <= covered / trials <= 0.99, covered / trials


def test_pooling_weighs_by_precision_and_flags_heterogeneity():
    rng = np.random.default_rng(5)

    def cell(k: float, noise: float):
        sa, xsa = study(rng, k=k, noise=noise)
        return cell_estimate(sa, BUDGETS, xsa, B)

    same = [cell(1.4, 0.01) for _ in range(4)]
    pooled = pool(same)
    assert pooled is not None and pooled["ci95"][0] < 1.4 < pooled["ci95"][1]
    assert pooled["q_p_value"] > 0.01
    mixed = same[:2] + [cell(0.7, 0.005) for _ in range(2)]
    assert pool(mixed)["q_p_value"] < 0.01


def _entry(model: str, sa, xsa_by_budget, seeds):
    runs = {
        "sa": {
            f"{f:g}": [
                {"seed": s, "status": "completed", "final_val_loss": v, "tokens_seen": f * B}
                for s, v in zip(seeds, losses, strict=True)
            ]
            for f, losses in zip([0.5, 1, 2], sa, strict=True)
        },
        "xsa": {
            f"{f:g}": [
                {"seed": s, "status": "completed", "final_val_loss": v, "tokens_seen": f * B}
                for s, v in zip(seeds, losses, strict=True)
            ]
            for f, losses in xsa_by_budget.items()
        },
    }
    return {"model": model, "tokens_B": B, "runs": runs, "seeds": seeds, "warnings": []}


def test_the_analysis_pairs_seeds_leaves_out_unfinished_ones_and_takes_wall_clock_only_from_bench():
    rng = np.random.default_rng(6)
    sa, xsa_b = study(rng, k=1.5, noise=0.005)
    _, xsa_half = study(rng, k=1.5, xsa_budget=B / 2, noise=0.005)
    entry = _entry("m", sa, {0.5: xsa_half, 1: xsa_b}, seeds=[1, 2, 3, 4, 5])
    entry["runs"]["xsa"]["1"][4]["status"] = "diverged"
    entry["bench"] = {"xsa_over_sa_step_time": 1.1, "interval": [1.05, 1.15]}
    analysis = analyse_tokens([entry], [0.5, 1, 2], [0.5, 1])
    at_b = next(c for c in analysis["cells"] if c["fraction"] == 1)
    assert at_b["paired_seeds"] == [1, 2, 3, 4] and any("1 seed(s) left out" in w for w in analysis["warnings"])
    assert at_b["wallclock_k"] == pytest.approx(at_b["k"] / 1.1)
    assert at_b["wallclock_ci"][0] == pytest.approx(at_b["ci95"][0] / 1.15)
    del entry["bench"]
    assert "wallclock_k" not in analyse_tokens([entry], [0.5, 1, 2], [0.5, 1])["cells"][0]
    assert analysis["pooled"]["cells"] == 2


def test_the_budget_counts_the_parameters_the_runs_will_build():
    """B follows the study's overrides (an experiment's or the command line's model.* keys) and the size's preset."""
    from hydra import initialize_config_module

    from xsa_lm.scale.tokens import non_embedding_params

    with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
        base = non_embedding_params("tiny_l3_d48", ["experiment=tokens_toy"])
        deeper = non_embedding_params("tiny_l3_d48", ["experiment=tokens_toy", "model.n_layer=4"])
    from xsa_lm.model.config import GPTConfig
    from xsa_lm.model.gpt import GPT

    four = GPT(GPTConfig(n_layer=4, d_model=48, n_head=3, head_dim=16, vocab_size=4096)).num_params(non_embedding=True)
    assert base == 83328 and deeper == four > base


def test_an_experiment_sets_the_scale_settings():
    """configs/_scale.yaml comes before the training config, so an experiment's scale.* values win."""
    tokens = compose_train(["experiment=tokens_toy"], config_name="scale")
    assert tokens.scale.axis == "tokens" and list(tokens.scale.models) == ["tiny_l3_d48", "tiny_l3_d64"]
    assert tokens.scale.tokens_per_param == 10 and list(tokens.sweep.search_seeds) == [0, 1]
    assert compose_train(["experiment=tokens_toy", "scale.axis=size"], config_name="scale").scale.axis == "size"
    assert compose_train([], config_name="scale").scale.axis == "size"


@pytest.mark.slow
@pytest.mark.long
def test_the_token_study_runs_end_to_end_and_resumes(tmp_path: Path, data_cache: Path):
    study_dir = tmp_path / "study"
    args = [
        "scale",
        "experiment=tokens_toy",
        "logger=csv",
        "data.val_windows=8",
        "scale.tokens_per_param=0.2",
        "scale.seeds=[2,3]",
        "scale.measure_throughput=false",
        "sweep.search_seeds=[0]",
        "sweep.lr_grids.tiny_l3_d48=[3e-2]",
        "sweep.lr_grids.tiny_l3_d64=[3e-2]",
        f"hydra.run.dir={study_dir}",
    ]
    first = run_cli(args, data_cache, cwd=tmp_path, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    results = json.loads((study_dir / "results.json").read_text())
    assert [c["model"] for c in results["cells"]] == ["tiny_l3_d48"] * 2 + ["tiny_l3_d64"] * 2
    d48 = results["sizes"][0]
    assert d48["non_embedding_params"] == 83328 and sorted(d48["runs"]["sa"]) == ["0.5", "1", "2"]
    steps = {
        f: json.loads(Path(d48["runs"]["sa"][f][0]["run_dir"], "summary.json").read_text())["steps"]
        for f in ("0.5", "1", "2")
    }
    assert steps == {"0.5": 2, "1": 4, "2": 8}  # 0.2 x 83,328 tokens per B at 4096 per step
    assert (study_dir / "loss_vs_tokens.png").exists() and "token axis" in (study_dir / "report.md").read_text()
    again = run_cli(args, data_cache, cwd=tmp_path, timeout=300)  # every run is reused
    assert again.returncode == 0 and "started" not in again.stdout
    changed = run_cli([*args[:-1], "scale.seeds=[2,3,4]", args[-1]], data_cache, cwd=tmp_path, timeout=300)
    assert changed.returncode == 2 and "planned with other statistics" in changed.stderr


def test_the_pooled_interval_covers_over_independent_cells():
    rng = np.random.default_rng(7)
    covered, trials = 0, 200
    for _ in range(trials):
        cells = []
        for budget in (B, B / 2):
            sa, xsa = study(rng, k=1.3, xsa_budget=budget)
            cells.append(cell_estimate(sa, BUDGETS, xsa, budget))
        pooled = pool(cells)
        covered += pooled["ci95"][0] <= 1.3 <= pooled["ci95"][1]
    assert 0.90 <= covered / trials <= 0.99, covered / trials


@pytest.mark.slow
@pytest.mark.parametrize(  # two refusals in make test, the other three in make test-long (each ~10 s, a process)
    "override, message",
    [
        ("scale.sa_budgets=[1]", "scale.sa_budgets needs 2+ positive budgets including 1"),
        pytest.param(
            "scale.xsa_budgets=[4]", "scale.xsa_budgets must lie within SA's budgets [0.5, 2]", marks=pytest.mark.long
        ),
        pytest.param(
            "trainer.max_steps=100",
            "trainer.max_steps=100: scale.axis=tokens sets each run's steps",
            marks=pytest.mark.long,
        ),
        ("scale.seeds=[1,2]", "scale.seeds=[1,2] contains the search seed(s) [1] (sweep.search_seeds)"),
        pytest.param("scale.seeds=[2]", "needs 2+ compare seeds", marks=pytest.mark.long),
    ],
)
def test_a_refused_token_study_writes_nothing(tmp_path: Path, data_cache: Path, override: str, message: str):
    study_dir = tmp_path / "study"
    args = ["scale", "experiment=tokens_toy", override, f"hydra.run.dir={study_dir}"]
    assert_clean_error(run_cli(args, data_cache, cwd=tmp_path), message)
    assert_nothing_written(study_dir)
