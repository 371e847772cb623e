"""`xsa-lm scale` compares sweep.baseline with its one candidate by name: the analysis reads the arms' runs by their
names, and the report, its warnings and flags name them; with the defaults (sa, [xsa]) all reads as before."""

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from tests.helpers import assert_nothing_written, refused_in_process, run_cli
from tests.test_scale import FLAG_LADDERS, clean_sizes, study_results
from tests.test_token_axis import PLAN, _entry, study
from xsa_lm.errors import UserError
from xsa_lm.scale.report import Arms, TokenPlan, TokenStudyResult, render_markdown
from xsa_lm.scale.run import analyse, analyse_tokens, load_bench

GATED = Arms(baseline="xsa", candidate="gated")  # a lab's variant against XSA: neither name is the paper's pair


def renamed(text: str) -> str:
    """The paper's report as it reads for GATED: XSA -> GATED, then SA -> XSA (labels only: keys are lower case)."""
    return re.sub(r"(?<![A-Za-z])SA\b", "XSA", re.sub(r"(?<![A-Za-z])XSA\b", "GATED", text))


def cells(report: str) -> str:
    """A report without its tables' padding (a longer name widens its column)."""
    return re.sub(r"[ :-]*\|[ :-]*", "|", report)


@pytest.mark.parametrize("ladder", ["clean", "extrapolation"])  # k in the report; the flags' reasons
def test_the_ladder_is_the_same_analysis_under_other_names_and_its_report_names_them(ladder: str, tmp_path: Path):
    sizes = clean_sizes() if ladder == "clean" else FLAG_LADDERS[ladder]()
    paper, gated = (analyse(sizes, "auto", resamples=2, seed=0, arms=arms) for arms in (Arms(), GATED))
    assert [f["flag"] for f in gated.fit["flags"]] == [f["flag"] for f in paper.fit["flags"]]
    assert gated.fit["shared"]["alpha"] == paper.fit["shared"]["alpha"]  # the same fit: only the names differ
    assert gated.fit["shared"]["formula"] == renamed(paper.fit["shared"]["formula"])
    assert gated.fit["shared"]["formula"].count("GATED: ") == 1
    report = render_markdown(replace(study_results(sizes, gated, tmp_path), arms=GATED))
    assert cells(report) == cells(renamed(render_markdown(study_results(sizes, paper, tmp_path))))
    assert report.startswith("# XSA vs GATED across model sizes")


def test_the_token_axis_reads_each_arms_runs_by_name_and_its_report_names_them():
    sa, xsa = study(np.random.default_rng(8), k=1.5, noise=0.005)
    paper = _entry("m", sa, {1: xsa}, seeds=[1, 2, 3, 4, 5])
    runs = paper.runs or {}
    gated = replace(paper, runs={"xsa": runs["sa"], "gated": runs["xsa"]})  # the same losses under other names
    (cell,) = analyse_tokens([paper], [0.5, 1, 2], [1], margin=0.01).cells
    (renamed_cell,) = analyse_tokens([gated], [0.5, 1, 2], [1], margin=0.01, arms=GATED).cells
    assert renamed_cell == cell and cell["k"] == pytest.approx(1.5, rel=0.05)
    with pytest.raises(KeyError):  # the paper's names are not looked up: no "sa" runs here
        analyse_tokens([gated], [0.5, 1, 2], [1])

    def report(entry, arms: Arms) -> str:
        plan = TokenPlan(**PLAN, margin=0.01, arms=arms)
        results = TokenStudyResult(study_dir="s", study_id="s", overrides=[], plan=plan, sizes=[entry], cells=[cell])
        return render_markdown(results)

    assert cells(report(gated, GATED)) == cells(renamed(report(paper, Arms())))
    assert report(gated, GATED).startswith("# XSA vs GATED along the token axis: GATED's multiplier")


def test_the_bench_ratio_is_read_under_the_arms_names(tmp_path: Path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"model": "m", "ratios": {"gated_over_xsa_step_time": {"median": 1.1}}}))
    assert load_bench(bench, arms=GATED).xsa_over_sa_step_time == {"median": 1.1}  # type: ignore[union-attr]
    with pytest.raises(UserError, match=r"no XSA/SA step time in it \(ratios.xsa_over_sa_step_time\)$"):
        load_bench(bench)


def test_a_study_of_two_candidates_is_refused_in_one_line_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    """A ladder's k is one arm's over the baseline: a second candidate is refused before the study folder."""

    def started(*args, **kwargs) -> None:
        raise AssertionError("the study started: the refusal came too late")

    monkeypatch.setattr("xsa_lm.scale.run.run_token_axis", started)
    configs = tmp_path / "lab" / "attention"
    configs.mkdir(parents=True)
    (configs / "xsa_last2.yaml").write_text("defaults: [xsa, _self_]\nname: xsa_last2\nlayers: 2\n")
    study_dir = tmp_path / "study"
    args = ["scale", "--config-dir", str(tmp_path / "lab"), "experiment=tokens_toy", f"hydra.run.dir={study_dir}"]
    said = refused_in_process([*args, "sweep.candidates=[xsa,xsa_last2]"], monkeypatch, capsys).strip()
    assert said == (
        "xsa-lm: error: sweep.candidates=[xsa,xsa_last2]: xsa-lm scale compares the baseline with one candidate; "
        "give one, e.g. sweep.candidates=[xsa]"
    )
    assert_nothing_written(study_dir)


@pytest.mark.slow
@pytest.mark.long
def test_a_token_study_of_other_arms_trains_and_benches_each_arm_by_name(tmp_path: Path, data_cache: Path):
    """XSA as the baseline and SA as the candidate, end to end at test size: each arm's runs train their own option,
    the bench times SA against XSA, and the report reads SA's multiplier over XSA."""
    study_dir = tmp_path / "study"
    args = [
        "scale",
        "experiment=tokens_toy",
        "logger=csv",
        "data.val_windows=8",
        "scale.tokens_per_param=0.2",
        "scale.models=[tiny_l3_d48]",
        "scale.seeds=[2,3]",
        "scale.measure_throughput=true",
        "scale.bench_rounds=6",
        "sweep.search_seeds=[0]",
        "sweep.lr_grids.tiny_l3_d48=[3e-2]",
        "sweep.baseline=xsa",
        "sweep.candidates=[sa]",
        f"hydra.run.dir={study_dir}",
    ]
    done = run_cli(args, data_cache, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((study_dir / "results.json").read_text())
    assert results["plan"]["arms"] == {"baseline": "xsa", "candidate": "sa"}
    (size,) = results["sizes"]
    assert sorted(size["runs"]["xsa"]) == ["0.5", "1", "2"] and sorted(size["runs"]["sa"]) == ["0.5", "1"]
    for arm, budgets in size["runs"].items():  # each run trained the attention option of its arm
        names = {OmegaConf.load(Path(r["run_dir"], "config.yaml")).attention.name for b in budgets.values() for r in b}
        assert names == {arm}, (arm, names)
    assert [(c["model"], c["fraction"]) for c in results["cells"]] == [("tiny_l3_d48", 0.5), ("tiny_l3_d48", 1.0)]
    bench = json.loads(Path(size["bench"]["file"]).read_text())
    assert bench["arms"] == {"baseline": "xsa", "candidate": "sa"} and bench["sa_over_xsa_step_time"] > 0
    assert size["bench"]["xsa_over_sa_step_time"] == bench["sa_over_xsa_step_time"]  # the candidate over the baseline
    report = (study_dir / "report.md").read_text()
    assert report.startswith("# XSA vs SA along the token axis: SA's multiplier at fixed model size")
