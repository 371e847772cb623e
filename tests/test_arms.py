"""The sweep's arms by name: a baseline (sweep.baseline) whose LR is searched, and candidates (sweep.candidates) each
compared with it, from the package's attention options or a lab's own (--config-dir)."""

import json
import os
import re
from pathlib import Path

import pytest

from tests.helpers import FAST, compose_train, refused_in_process, run_cli
from xsa_lm.config.spec import parse
from xsa_lm.eval.run import EvalResult, Row, Score, compared, render
from xsa_lm.sweep.protocol import NULL, PLACEBO, Trial, select_lr
from xsa_lm.sweep.report import build_results, render_markdown
from xsa_lm.sweep.settings import SweepSpec
from xsa_lm.sweep.trials import TrialRecord, trial_settings

SWEEP_FAST = [o for o in FAST if not o.startswith(("optim.lr=", "progress_bar="))]

# The lab's variant, defined outside xsa_lm/: the worked example of docs/variants.md, a package (put on PYTHONPATH)
# and its attention option file in its own config folder (for --config-dir). The one place a test names it.
EXAMPLE = Path(__file__).parents[1] / "docs" / "examples" / "gated_attention"
VARIANT = "gated"
VARIANT_FILES = {"configs/attention/xsa_last2.yaml": "defaults:\n  - xsa\n  - _self_\n\nname: xsa_last2\nlayers: 1\n"}


def lab_folder(root: Path, files: dict[str, str] = VARIANT_FILES) -> Path:
    """A lab's folder holding its files; returns its config folder (for --config-dir)."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "configs"


def record(phase: str, attention: str, seed: int, loss: float | str, lr: float = 1e-3) -> TrialRecord:
    done = isinstance(loss, float)
    return TrialRecord(
        id=Trial(attention, lr, seed).id, phase=phase, attention=attention, lr=lr, seed=seed,
        status="completed" if done else str(loss), final_val_loss=loss if done else None,
    )  # fmt: skip


def test_each_candidate_is_compared_with_the_baseline_under_its_name() -> None:
    """Three arms: one comparison per candidate, its own pairs (a failed candidate drops only its own seed)."""
    losses = {
        "gated": {1: 3.0, 2: 3.1, 3: 3.2},
        "xsa": {1: 2.9, 2: 3.0, 3: "failed"},
        "sa_wide": {1: 3.1, 2: 3.3, 3: 3.2},
    }
    trials = [record("search", "gated", 0, 3.0)]
    trials += [
        record("compare", arm, seed, loss) for seed in (1, 2, 3) for arm, by in losses.items() for loss in [by[seed]]
    ]
    results = build_results(
        Path("sweep"), sweep_id="s", grid=[1e-3], seeds=[1, 2, 3], train_overrides=[], trials=trials,
        arms=["gated", "xsa", "sa_wide"], selection=select_lr({1e-3: [("completed", 3.0)]}),
    )  # fmt: skip
    assert (results.baseline, results.candidates) == ("gated", ["xsa", "sa_wide"])
    xsa, wide = results.by_candidate
    assert (xsa.candidate, xsa.comparison.seeds, xsa.comparison.diff) == ("xsa", [1, 2], pytest.approx([-0.1, -0.1]))
    assert (wide.candidate, wide.comparison.seeds, wide.comparison.diff) == (
        "sa_wide",
        [1, 2, 3],
        pytest.approx([0.1, 0.2, 0]),
    )
    assert results.comparison == xsa.comparison  # the first candidate's under the two-arm protocol's keys
    assert xsa.comparison.dropped_seeds == [{"seed": 3, "gated": "completed", "xsa": "failed"}]
    assert [row["sa_wide"] for row in wide.compare_table] == ["3.1000", "3.3000", "3.2000"]
    markdown = re.sub(" +", " ", render_markdown(results))
    assert markdown.startswith("# GATED vs XSA, SA_WIDE: LR search on GATED, comparison at the shared LR")
    for heading in ("## 2. GATED vs XSA at the shared LR", "## 2. GATED vs SA_WIDE at the shared LR"):
        assert markdown.count(heading) == 1
    assert (
        "| XSA - GATED |" in markdown and "| SA_WIDE - GATED |" in markdown and "SA_WIDE is lower in 0 of 3" in markdown
    )
    assert "seed 3 is left out of" in markdown and "XSA failed" in markdown
    again = type(results).from_json(json.loads(json.dumps(results.to_json())))
    assert again == results  # results.json reads back, every candidate with it


def test_the_null_arms_are_the_baseline_from_other_weights_or_from_its_own_perturbed() -> None:
    cfg = compose_train(["sweep.baseline=gated", "sweep.placebo_scale=1e-5"], config_name="sweep")
    spec = parse(SweepSpec, cfg.sweep)
    assert trial_settings(Trial("xsa", 1e-3, 2), spec)[0] == "attention=xsa"
    null = trial_settings(Trial(NULL, 1e-3, 2), spec)
    assert null[0] == "attention=gated" and null[1].startswith("init_seed=") and null[1] != "init_seed=2"
    assert trial_settings(Trial(PLACEBO, 1e-3, 2), spec)[:2] == ["attention=gated", "init_perturbation=1e-05"]


def test_the_evaluation_compares_every_other_arm_with_the_baseline() -> None:
    """eval.json and eval.md: a difference and its interval per other arm, by name, from each arm's mean."""
    scores = {"gated": [0.4, 0.6], "xsa": [0.7], "sa_wide": [0.2]}
    rows = [
        Row(checkpoint=f"/r/{arm}{i}/checkpoints/last.ckpt", attention=arm, run=f"{arm}{i}", average=value,
            scores={"t": Score(metric="acc", value=value, n=4, stderr=None)})
        for arm, values in scores.items() for i, value in enumerate(values)
    ]  # fmt: skip
    items = [{"t": dict(enumerate(answers))} for answers in ([1, 0, 1, 0], [1, 1, 0, 1], [1, 1, 1, 0], [0, 0, 1, 0])]
    result = compared(EvalResult(tasks=["t"], limit=None, rows=rows, baseline="gated"), items)
    xsa, wide = result.by_candidate
    assert (xsa.candidate, xsa.mean["t"], xsa.counts) == ("xsa", pytest.approx(0.2), (1, 2))
    assert (wide.candidate, wide.mean["t"], wide.counts) == ("sa_wide", pytest.approx(-0.3), (1, 2))
    assert xsa.ci95 is not None and xsa.ci95["t"] is not None  # paired over the items: [1,1,1,0] - mean of the two
    markdown = render(EvalResult.from_json(json.loads(json.dumps(result.to_json()))))
    assert "| XSA - GATED (means of 1 and 2 checkpoints) | +20.00 |" in re.sub(" +", " ", markdown)
    assert "| SA_WIDE - GATED (means of 1 and 2 checkpoints) | -30.00 |" in re.sub(" +", " ", markdown)


REFUSALS = [
    ("sweep.candidates=[]", "sweep.candidates=[] must list one or more attention options"),
    ("sweep.candidates=[xsa,xsa]", "lists xsa twice: list each arm once"),
    ("sweep.candidates=[xsa,sa]", "sweep.candidates=[xsa,sa] contains the baseline sa (sweep.baseline)"),
    ("sweep.baseline=null", "sweep.baseline=null must be the name of an attention option"),
    ("sweep.candidates=[null]", "must be the name of an attention option"),
    ("sweep.baseline=nosuch", "name nosuch, which is no attention option (available: renamed, sa, xsa)"),
    ("sweep.candidates=[xsa,xsa_last3]", "name xsa_last3, which is no attention option"),
    ("sweep.candidates=[xsa,renamed] sweep.seeds_until_significant=4", "sweep.candidates=[xsa,renamed] makes 2"),
    ("sweep.candidates=[renamed]", "the attention option renamed has name: xsa: an arm's name must be its option's"),
]


@pytest.mark.parametrize(("override", "message"), REFUSALS, ids=[o for o, _ in REFUSALS])
def test_a_bad_arm_is_refused_in_one_line_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, override: str, message: str
) -> None:
    configs = lab_folder(tmp_path / "lab", {"configs/attention/renamed.yaml": "defaults:\n  - xsa\n  - _self_\n"})
    monkeypatch.chdir(tmp_path / "lab")
    args = ["sweep", "--config-dir", str(configs), *SWEEP_FAST, "sweep.lrs=[1e-3]", *override.split()]
    lines = refused_in_process(args, monkeypatch, capsys).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xsa-lm: error: ") and message in lines[0], lines
    assert sorted(p.name for p in (tmp_path / "lab").iterdir()) == ["configs"]  # no sweep folder, no outputs/


@pytest.mark.long
def test_a_three_arm_sweep_from_a_lab_config_folder(tmp_path: Path, data_cache: Path) -> None:
    """SA, XSA and the lab's variant (its option file in its own --config-dir): the search on SA, every candidate at
    SA's LR on every compare seed, the null arm, and a report with one comparison per candidate."""
    configs, sweep_dir = EXAMPLE / "configs", tmp_path / "sweep"
    args = ["sweep", "--config-dir", str(configs), *SWEEP_FAST, "trainer.max_steps=10", "val_every_steps=5"]
    args += ["sweep.lrs=[3e-3]", "sweep.seeds=[1,2]", f"sweep.candidates=[xsa,{VARIANT}]", "sweep.null_arm=true"]
    proc = run_cli(
        [*args, f"hydra.run.dir={sweep_dir}"],
        data_cache,
        tmp_path,
        timeout=900,
        PYTHONPATH=os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")]),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((sweep_dir / "results.json").read_text())
    assert (results["baseline"], results["candidates"]) == ("sa", ["xsa", VARIANT])
    trials = {(t["phase"], t["attention"], t["seed"]) for t in results["trials"] if t["status"] == "completed"}
    assert trials == {("search", "sa", 0)} | {
        (phase, arm, seed) for seed in (1, 2) for phase, arm in [("compare", "sa"), ("compare", "xsa"),
                                                                ("compare", VARIANT), ("null", NULL)]
    }  # fmt: skip
    summary = json.loads((sweep_dir / "runs" / f"{VARIANT}_lr0.003_s1" / "summary.json").read_text())
    assert summary["attention"] == VARIANT  # the lab's option trained under its name
    comparisons = [results["comparison"], *(c["comparison"] for c in results["more_candidates"])]
    assert [c["candidate"] for c in results["more_candidates"]] == [VARIANT]
    assert all(c["seeds"] == [1, 2] and c["diff_mean"] is not None for c in comparisons)
    assert comparisons[0]["diff_mean"] != comparisons[1]["diff_mean"]  # each its own candidate's losses
    report = re.sub(" +", " ", (sweep_dir / "report.md").read_text())
    for text in ("## 2. SA vs XSA at the", f"## 2. SA vs {VARIANT.upper()} at the", f"{VARIANT.upper()} is lower in"):
        assert report.count(text) == 1, text
    assert "| init null - SA |" in report
