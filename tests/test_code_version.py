"""Runs tied to their code: a study refuses to reuse a run trained by other code, unless sweep.allow_mixed_code, and
its report lists the runs by code version."""

import dataclasses
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import xsa_lm
from tests.helpers import FAST, refused_in_process
from tests.leftovers import nothing_left_behind
from tests.test_scale import STUDY
from xsa_lm.errors import UserError
from xsa_lm.records import CodeVersion
from xsa_lm.scale.run import sweep_overrides
from xsa_lm.sweep.protocol import Trial, select_lr
from xsa_lm.sweep.report import build_results, render_markdown
from xsa_lm.sweep.trials import Launcher, TrialRecord, TrialStore, refuse_other_code, runs_by_code
from xsa_lm.train.runinfo import code_version

HERE = code_version()
OTHER_SOURCE = dataclasses.replace(HERE, commit="0123456789abcdef", dirty=True, source_sha256="f" * 64)
OTHER_TORCH = dataclasses.replace(HERE, torch="1.0.0")
SWEEP_FAST = [o for o in FAST if not o.startswith(("optim.lr=", "progress_bar="))]


def _trial(seed: int, code: CodeVersion | None, lr: float = 1e-3) -> TrialRecord:
    trial = Trial("sa", lr, seed)
    record = TrialRecord.missing(trial, "search")
    return dataclasses.replace(record, status="completed", final_val_loss=4.0 + seed / 10, code=code)


def _folder(folder: Path, *records: TrialRecord) -> Path:
    store = TrialStore(folder)
    for record in records:
        store.save(record)
    return folder


STUDIES = {  # a study's command, and where it keeps a trial record it reuses
    "sweep": (["sweep", *SWEEP_FAST, "sweep=demo"], "."),
    "scale": (["scale", *STUDY, "scale.axis=size"], "sizes/tiny_d32"),
}


@pytest.mark.parametrize(("args", "records"), STUDIES.values(), ids=STUDIES)
def test_a_study_refuses_to_reuse_a_run_of_other_code_in_one_line(tmp_path, monkeypatch, capsys, args, records) -> None:
    """Before anything starts or is written: the trials (first few and a count), both versions and the fix."""
    study = tmp_path / "study"
    _folder(study / records, *(_trial(seed, OTHER_SOURCE) for seed in range(5)), _trial(9, HERE))
    monkeypatch.setattr(Launcher, "_start", lambda *_: pytest.fail("a trial started: the refusal came too late"))
    monkeypatch.chdir(tmp_path)
    with nothing_left_behind(tmp_path):
        lines = refused_in_process([*args, f"hydra.run.dir={study}"], monkeypatch, capsys).strip().splitlines()
    assert len(lines) == 1, lines
    assert "holds 5 run(s) that this rerun would reuse or resume, trained by other code: " in lines[0], lines[0]
    assert "sa_lr0.001_s0, sa_lr0.001_s1, sa_lr0.001_s2 and 2 more by " in lines[0] and "_s9" not in lines[0]
    assert f"by {OTHER_SOURCE}; this is {HERE}: " in lines[0] and "commit 0123456789ab+dirty" in lines[0]
    fix = "use another hydra.run.dir, or mix them with sweep.allow_mixed_code=true (the report lists the runs by code"
    assert lines[0].endswith(f"{fix} version)")


CODES = {  # the code of a reused run -> whether this code is another
    "none recorded": (None, True),
    "other source": (OTHER_SOURCE, True),
    "other torch": (OTHER_TORCH, True),
    "same source elsewhere": (dataclasses.replace(HERE, commit="elsewhere", dirty=True), False),
}


@pytest.mark.parametrize("how", ["finished", "resumed"])
@pytest.mark.parametrize(("code", "other"), CODES.values(), ids=CODES)
def test_runs_of_this_code_are_reused_or_resumed_silently_and_allow_mixed_code_takes_any(tmp_path, code, other, how):
    """A finished run by its summary's code; an unfinished one that a rerun resumes by the code that started it
    (run_info.json's), where it left a checkpoint (without one it starts afresh). sweep.allow_mixed_code is no override
    a rerun must keep (a sweep's trials and a study get no sweep.* key)."""
    assert sweep_overrides(["sweep.seeds=[1,2]", "sweep.allow_mixed_code=true"]) == ["sweep.seeds=[1,2]"]
    if how == "finished":
        folder = _folder(tmp_path / "sweep", _trial(0, HERE), _trial(1, code))
    else:
        run = tmp_path / "sweep" / "runs" / "sa_lr0.001_s1"
        unfinished = dataclasses.replace(_trial(1, None), status="failed", run_dir=str(run))
        folder = _folder(tmp_path / "sweep", _trial(0, HERE), unfinished)
        run.mkdir(parents=True)
        (run / "run_info.json").write_text(json.dumps({"started_at": "then", "code": code and code.to_json()}))
        refuse_other_code(folder, False, HERE)  # no checkpoint: nothing resumed
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    refuse_other_code(folder, True, HERE)
    if not other:
        refuse_other_code(folder, False, HERE)
        return
    named = str(code) if code else "no recorded code version"
    with pytest.raises(
        UserError,
        match=re.escape(
            f"1 run(s) that this rerun would reuse or resume, trained by other "
            f"code: sa_lr0.001_s1 by {named}; this is {HERE}"
        ),
    ):
        refuse_other_code(folder, False, HERE)


def test_the_report_lists_the_runs_by_code_version() -> None:
    """One version: one line; several (sweep.allow_mixed_code): a row each, with its runs."""
    selection = select_lr({1e-3: [("completed", 4.0)], 3e-3: [("completed", 4.1)]})
    runs = [_trial(0, HERE), _trial(0, OTHER_SOURCE, lr=3e-3), _trial(1, None, lr=3e-3)]

    def report(trials: list[TrialRecord]) -> str:
        args = dict(grid=[1e-3, 3e-3], seeds=[], search_seeds=[0, 1], train_overrides=[], arms=["sa", "xsa"])
        results = build_results(Path("sweep"), sweep_id="s", trials=trials, selection=selection, **args)
        assert type(results).from_json(results.to_json()).code == results.code  # results.json carries it
        return render_markdown(results)

    assert f"- code: {HERE} (all 1 finished runs)\n" in report(runs[:1])
    mixed = report(runs)
    assert "- code: 3 versions trained these runs (sweep.allow_mixed_code=true)" in mixed
    rows = [line for line in mixed.splitlines() if line.startswith("| ") and "sa_lr" in line]
    assert len(rows) == 3 and "| 0123456789ab (ffffffff) | True " in rows[1] and "not recorded" in rows[2], rows
    assert rows[0].rstrip(" |").endswith("sa_lr0.001_s0") and rows[2].rstrip(" |").endswith("sa_lr0.003_s1")


def test_a_studys_runs_are_counted_once_each_though_budgets_repeat_their_ids(tmp_path: Path) -> None:
    """The token axis names a run alike at every budget: counted by run folder, named by its path in the study."""
    runs = [
        dataclasses.replace(_trial(2, HERE), run_dir=str(tmp_path / f"sizes/m/budget_{b}/runs/sa_lr0.001_s2"))
        for b in ("0.5", "1")
    ]
    reused = dataclasses.replace(runs[0], phase="compare", reused=True)  # a sweep's reused trial: the same run
    (row,) = runs_by_code([*runs, reused], tmp_path)
    assert row.trials == ["sizes/m/budget_0.5/runs/sa_lr0.001_s2", "sizes/m/budget_1/runs/sa_lr0.001_s2"]
    assert runs_by_code(runs[:1], tmp_path)[0].trials == ["sa_lr0.001_s2"]  # ids alone where they do not repeat


@pytest.mark.slow
def test_the_source_hash_covers_the_bundled_configs_alike_installed_or_from_a_checkout(tmp_path: Path) -> None:
    """The package as a wheel installs it (its configs inside it) hashes as this checkout does; a changed bundled
    config changes the hash (a config trains another model as surely as code does)."""
    installed = tmp_path / "site" / "xsa_lm"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(xsa_lm.__file__).parent, installed, ignore=shutil.ignore_patterns("__pycache__", "configs"))
    shutil.copytree(Path(str(importlib.resources.files("xsa_lm.configs"))), installed / "configs", ignore=skip)

    def source_hash() -> str:
        code = "from xsa_lm.train.runinfo import source_sha256; print(source_sha256())"
        env = {**os.environ, "PYTHONPATH": str(installed.parent)}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True
        ).stdout.strip()

    assert source_hash() == HERE.source_sha256
    train = installed / "configs" / "train.yaml"
    train.write_text(train.read_text() + "\n# another config\n")
    assert source_hash() != HERE.source_sha256
