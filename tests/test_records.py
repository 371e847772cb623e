"""The JSON files one layer writes and another reads, as typed records: the files under results/ are read, a file of
another schema version, a key missing or a value of another type is refused in one line naming the file."""

import json
from pathlib import Path

import pytest

from xsa_lm.errors import UserError
from xsa_lm.scale.report import ScaleStudyResult, TokenStudyResult
from xsa_lm.sweep.report import SweepResult
from xsa_lm.sweep.trials import TrialRecord, outcome
from xsa_lm.train.summary import RunSummary

REPO = Path(__file__).resolve().parents[1]
SWEEP_RESULTS = sorted(p for p in REPO.glob("results/*/results.json") if "sweep_id" in json.loads(p.read_text()))
STUDY_RESULTS = [REPO / "results" / "scale_toy" / "results.json", REPO / "tests" / "data" / "scale_toy_results.json"]

SUMMARY = {  # summary.json as `xsa-lm train` writes it
    "schema": 1,
    "final_val_bpb": None,
    "final_val_loss_by_position": [],
    "data_epochs": None,
    "status": "completed",
    "error": None,
    "attention": "xsa",
    "model": "tiny",
    "lr": 0.003,
    "peak_lr": 0.003,
    "precision": "32-true",
    "seed": 1,
    "final_val_loss": 5.1,
    "final_val_ppl": 164.0,
    "best_val_loss": 5.1,
    "steps": 40,
    "tokens_seen": 40960,
    "tokens_per_s": 9000.0,
    "wall_time_s": 12.5,
    "non_embedding_params": 12345,
    "diverged_at_step": None,
    "events": [],
    "val_history": [{"step": 40, "tokens": 40960, "val_loss": 5.1}],
    "run_dir": "runs/xsa_lr0.003_s1",
    "checkpoints": {"last": "runs/xsa_lr0.003_s1/checkpoints/last.ckpt", "best": None},
    "model_config": {"vocab_size": 512, "n_layer": 2},
    "code": {"package": "0.1.0", "commit": "a" * 40, "dirty": False, "source_sha256": "b" * 64, "torch": "2.5.1"},
    "cpu_threads": 2,
}


@pytest.mark.parametrize("path", SWEEP_RESULTS, ids=lambda p: p.parent.name)
def test_the_sweep_results_under_results_are_read(path: Path) -> None:
    saved = json.loads(path.read_text())
    sweep = SweepResult.read(path)
    assert sweep.selected_lr == saved["selected_lr"] and sweep.comparison.seeds == saved["comparison"]["seeds"]
    assert [t.id for t in sweep.trials] == [t["id"] for t in saved["trials"]]
    assert sweep.search_seeds == saved.get("search_seeds", [saved.get("search_seed")])  # older: one search seed
    again = sweep.to_json()
    assert again["comparison"]["diff_mean"] == saved["comparison"]["diff_mean"] and again["schema"] == 1
    assert SweepResult.from_json(again) == sweep


@pytest.mark.parametrize("path", STUDY_RESULTS, ids=lambda p: p.parent.name)
def test_a_saved_scaling_study_is_read(path: Path) -> None:
    saved = json.loads(path.read_text())["sizes"]
    sizes = ScaleStudyResult.read(path).sizes
    assert [s.model for s in sizes] == [s["model"] for s in saved]
    usable = [raw.get("compute") is not None and raw.get("error") is None for raw in saved]
    assert [s.usable for s in sizes] == usable
    assert [s.sa_runs for s in sizes] == [s["sa_runs"] for s in saved]


def test_a_summary_round_trips_and_what_the_sweep_makes_of_it() -> None:
    summary = RunSummary.from_json(SUMMARY)
    assert summary.schema == 1 and summary.to_json() == SUMMARY
    trial = TrialRecord(id="xsa_lr0.003_s1", phase="compare", attention="xsa", lr=0.003, seed=1, status="running")
    ended = trial.ended(outcome(0, summary, "", None), returncode=0)
    assert (ended.status, ended.final_val_loss, ended.steps, ended.returncode) == ("completed", 5.1, 40, 0)
    assert ended.code == summary.code  # what a rerun compares before reusing the trial


REFUSED = {  # (record, the file's content) -> the one line after its path
    "another version": (RunSummary, SUMMARY | {"schema": 99}, "schema 99, but this xsa-lm reads schema 1: run the"),
    "no version": (RunSummary, {k: v for k, v in SUMMARY.items() if k != "schema"}, "no schema in it: not written by"),
    "keys missing": (
        RunSummary,
        {k: v for k, v in SUMMARY.items() if k not in ("steps", "model_config")},
        "no steps, model_config in it: not written by xsa-lm, or cut short",
    ),
    "another type": (RunSummary, SUMMARY | {"steps": "many"}, "steps: Input should be a valid integer"),
    "no object": (RunSummary, [1, 2], "not a RunSummary record (a JSON object)"),
    "not JSON": (RunSummary, "{not json", "not JSON"),
    "a trial record": (TrialRecord, {"id": "sa_lr0.001_s0", "phase": "search", "lr": 1e-3}, "no schema, attention, "),
}


@pytest.mark.parametrize("kind, content, line", REFUSED.values(), ids=REFUSED.keys())
def test_a_file_that_is_no_record_of_this_version_is_refused_in_one_line(kind, content, line: str, tmp_path) -> None:
    path = tmp_path / "record.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(UserError) as error:
        kind.read(path)
    assert str(error.value).startswith(f"{path}: {line}") and "\n" not in str(error.value), error.value


def test_the_token_study_under_results_is_read() -> None:
    path = REPO / "results" / "tokens_toy" / "results.json"
    saved = json.loads(path.read_text())
    study = TokenStudyResult.read(path)
    assert [s.model for s in study.sizes] == [s["model"] for s in saved["sizes"]] and study.cells == saved["cells"]
    loss = (study.sizes[0].runs or {})["sa"]["1"][0].final_val_loss
    assert loss == saved["sizes"][0]["runs"]["sa"]["1"][0]["final_val_loss"]


def test_a_size_of_the_study_is_read_from_its_sweep_and_a_run_summary(tmp_path: Path) -> None:
    """scale.run.size_result reads the size's sweep results.json and one compare run's summary.json as records."""
    from dataclasses import asdict, replace

    from xsa_lm.model.config import GPTConfig
    from xsa_lm.scale.run import size_result

    saved = SweepResult.read(REPO / "results" / "demo_noise" / "results.json")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = asdict(GPTConfig(n_layer=2, d_model=64, n_head=2, head_dim=32, vocab_size=512))
    (run_dir / "summary.json").write_text(json.dumps(SUMMARY | {"model_config": config}))
    trials = [replace(t, run_dir=str(run_dir)) for t in saved.trials]
    sweep_dir = tmp_path / "sizes" / "tiny"
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "results.json").write_text(json.dumps(replace(saved, trials=trials).to_json()))
    size = size_result("tiny", sweep_dir, finished=True)
    assert size.usable and size.sa_runs == saved.comparison.sa and size.diff_ci95 == saved.comparison.diff_ci95
    assert (size.tokens, size.non_embedding_params) == (40960, 12345) and size.compute is not None and size.compute > 0
    compare = [t for t in saved.trials if t.phase == "compare" and t.attention == "xsa" and t.tokens_per_s]
    assert size.xsa_tokens_per_s == pytest.approx(sum(t.tokens_per_s or 0 for t in compare) / len(compare))
    assert size.sweep_returncode == 0 and size_result("tiny", sweep_dir, finished=False).sweep_returncode == 1
