"""A lab's own Lightning callbacks and loggers from config (the `callbacks` group, `logger.<name>`): built after
xsa-lm's own, which stay as they were; a `_target_` or arguments that cannot build one are refused in one line before
the run folder is made. And a train on a machine with `srun` but outside a SLURM job prints no "prepend srun" hint."""

import json
import os
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from tests.helpers import FAST, assert_nothing_written, assert_refused, compose_train, run_cli
from xsa_lm.checkpoints.atomic import AsyncSave, FolderCheckpoint
from xsa_lm.compat import quiet_third_party
from xsa_lm.config.spec import TrainSpec, parse
from xsa_lm.errors import UserError
from xsa_lm.tracking import RunCSVLogger
from xsa_lm.train.callbacks import (
    AttentionKernels,
    Diagnostics,
    Preemption,
    Profiler,
    ProgressBar,
    Samples,
    SavedConfig,
    Throughput,
    ValHistory,
)
from xsa_lm.train.cluster import ClusterChecks, check_slurm_tasks
from xsa_lm.train.run import make_callbacks, make_loggers, make_trainer

BUILT_IN = [ClusterChecks, AttentionKernels, FolderCheckpoint, FolderCheckpoint, ValHistory, Throughput, Preemption]
BUILT_IN += [SavedConfig]
OPTIONAL = ["diagnostics.every_n_steps=5", "samples.every_n_steps=5", "profile.start_step=2"]
ASYNC = ["trainer=fsdp", "trainer.strategy.save_distributed_checkpoint=true", "checkpoint.async_save=true"]
LAB = f"{__name__}.Marker"  # the class below, as a lab's config names its own
LR_MONITOR = "lightning.pytorch.callbacks.LearningRateMonitor"


class Marker(Callback):
    """A callback of a lab's own, as the command line can name one (built with its config's keys)."""

    def __init__(self, note: str) -> None:
        self.note = note


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], [*BUILT_IN, ProgressBar]),  # the defaults: the list as it was before the group
        (["progress_bar=false"], BUILT_IN),
        (OPTIONAL, [*BUILT_IN, Diagnostics, Samples, Profiler, ProgressBar]),
        (ASYNC, [*BUILT_IN, AsyncSave, ProgressBar]),
        ([f"+callbacks.mine._target_={LAB}", "+callbacks.mine.note=hi"], [*BUILT_IN, ProgressBar, Marker]),
        ([f"+callbacks.mine._target_={LAB}", "+callbacks.mine._args_=[hi]"], [*BUILT_IN, ProgressBar, Marker]),
    ],
)
def test_the_callbacks_are_xsa_lms_own_in_their_order_then_the_labs(overrides, expected, tmp_path: Path):
    spec = parse(TrainSpec, compose_train(overrides))
    callbacks = make_callbacks(spec, {}, tmp_path, val_set={}).all
    assert [type(c) for c in callbacks] == expected
    assert [c.dirpath for c in callbacks[2:4]] == [str(tmp_path / "checkpoints")] * 2  # best, then the step ones
    assert [c.filename for c in callbacks[2:4]] == ["best", "step-{step:06d}"]
    if expected[-1] is Marker:
        assert callbacks[-1].note == "hi"


MARK = """import json
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger


class Mark(Callback):
    def __init__(self, path, note):
        self.path, self.note = path, note

    def on_train_end(self, trainer, pl_module):
        with open(self.path, "w") as f:
            json.dump({"note": self.note, "step": trainer.global_step}, f)


class Record(Logger):  # appends the names of the metrics it is given, a line per call
    def __init__(self, path):
        super().__init__()
        self.path = path

    name, version = "record", 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        with open(self.path, "a") as f:
            f.write(json.dumps(sorted(metrics)) + "\\n")
"""


@pytest.mark.long  # trains
def test_a_labs_callbacks_and_logger_run_from_its_package_and_its_config_folder(data_cache: Path, tmp_path: Path):
    """A callback and a logger from files in the lab's --config-dir (`callbacks=[default,mine]`, `logger=[csv,mine]`),
    a callback from the command line only; `srun` on PATH (SLURM installed), but no SLURM job: no hint to use it."""
    lab, run_dir = tmp_path / "lab", tmp_path / "run"
    (lab / "lab_callbacks").mkdir(parents=True)
    (lab / "lab_callbacks" / "__init__.py").write_text(MARK)
    for group, node in [
        ("callbacks", f"_target_: lab_callbacks.Mark\n  path: {tmp_path / 'from_file.json'}\n  note: file"),
        ("logger", f"_target_: lab_callbacks.Record\n  path: {tmp_path / 'metrics.jsonl'}"),
    ]:
        (lab / "configs" / group).mkdir(parents=True)
        (lab / "configs" / group / "mine.yaml").write_text(f"mine:\n  {node}\n")
    args = ["train", "--config-dir", str(lab / "configs"), *FAST, "callbacks=[default,mine]", "logger=[csv,mine]"]
    args += ["+callbacks.cli._target_=lab_callbacks.Mark", f"+callbacks.cli.path={tmp_path / 'from_cli.json'}"]
    args += ["+callbacks.cli.note=cli", "trainer.max_steps=3", f"hydra.run.dir={run_dir}"]
    pythonpath = os.pathsep.join([str(lab), *filter(None, [os.environ.get("PYTHONPATH")])])
    path = os.pathsep.join([str(fake_srun(tmp_path)), os.environ["PATH"]])
    out = run_cli(args, data_cache, tmp_path, PYTHONPATH=pythonpath, PATH=path, SLURM_JOB_ID="")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    for name in ("file", "cli"):
        assert json.loads((tmp_path / f"from_{name}.json").read_text()) == {"note": name, "step": 3}
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum("train/loss" in keys for keys in logged) == 3 and any("val/loss" in keys for keys in logged)
    assert "srun" not in out.stdout + out.stderr


def fake_srun(tmp_path: Path) -> Path:
    """A folder holding an `srun`, as on a machine with SLURM installed (Lightning looks it up on PATH)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    (folder / "srun").write_text("#!/bin/sh\nexit 0\n")
    (folder / "srun").chmod(0o755)
    return folder


@pytest.mark.parametrize("in_a_job, hinted", [(False, False), (True, True)])
def test_the_srun_hint_is_shown_only_inside_a_slurm_job(
    in_a_job: bool, hinted: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
):
    """Inside an allocation, a train without srun may be a mistake (Lightning's hint stays); outside, it cannot be."""
    monkeypatch.setenv("PATH", os.pathsep.join([str(fake_srun(tmp_path)), os.environ["PATH"]]))
    for variable in ("SLURM_JOB_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(variable, raising=False)
    if in_a_job:
        monkeypatch.setenv("SLURM_JOB_ID", "1")
    quiet_third_party()  # as train's main does first
    check_slurm_tasks(devices=1, num_nodes=1)  # Lightning's SLURM detection, which warns too
    make_trainer(parse(TrainSpec, compose_train(FAST)), tmp_path, callbacks=[], loggers=[])
    assert any("`srun` command is available" in str(w.message) for w in recwarn) == hinted


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["+callbacks.mine._target_=lab_nowhere.Mark"], "callbacks.mine._target_=lab_nowhere.Mark cannot be imported "),
        (["+callbacks.mine._target_=xsa_lm.Nope"], "=xsa_lm.Nope cannot be imported (module 'xsa_lm' has no attribute"),
        (["+callbacks.mine._target_=collections.OrderedDict"], "=collections.OrderedDict is not a Lightning Callback"),
        (["+callbacks.mine._target_=Mark"], "callbacks.mine._target_=Mark must name a class by its module"),
        ([f"+callbacks.mine._target_={LAB}"], f"callbacks.mine cannot build {LAB}(note: str): missing a required "),
        ([f"+callbacks.m._target_={LAB}", "+callbacks.m.note=a", "+callbacks.m.nope=1"], "got an unexpected keyword"),
        ([f"+callbacks.m._target_={LR_MONITOR}", "+callbacks.m.every=1"], "argument 'every'"),
        (["+logger.mine._target_=lightning.pytorch.loggers.CSVLogger"], "logger.mine cannot build "),
        ([f"+logger.mine._target_={LAB}"], f"logger.mine._target_={LAB} is not a Lightning Logger class"),
        (["+logger.mine.save_dir=x"], "logger.mine._target_ is missing from the config"),
    ],
)
def test_a_callback_or_logger_that_cannot_be_built_is_refused_in_one_line(overrides: list[str], said: str):
    with pytest.raises(UserError) as refused:
        parse(TrainSpec, compose_train(overrides))
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_a_refused_callback_leaves_no_run_folder(data_cache: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    args = ["train", *FAST, f"+callbacks.lr._target_={LR_MONITOR}", "+callbacks.lr.every=1", f"hydra.run.dir={run_dir}"]
    said = f"callbacks.lr cannot build {LR_MONITOR}(", "): got an unexpected keyword argument 'every'"
    assert_refused(run_cli(args, data_cache, tmp_path), *said)
    assert_nothing_written(run_dir)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["logger=csv"], [RunCSVLogger]),
        (["logger=csv", "+logger.mine._target_=lightning.pytorch.loggers.CSVLogger"], [RunCSVLogger, CSVLogger]),
        (["logger=none", "+logger.mine._target_=lightning.pytorch.loggers.CSVLogger"], [CSVLogger]),
    ],
)
def test_a_labs_logger_comes_after_xsa_lms_own(overrides: list[str], expected: list[type], tmp_path: Path):
    lab = [f"+logger.mine.save_dir={tmp_path / 'lab'}"] if len(overrides) > 1 else []
    loggers = make_loggers(parse(TrainSpec, compose_train(overrides + lab)), {}, tmp_path, resume_step=None)
    assert [type(logger) for logger in loggers] == expected


def test_a_config_saved_before_the_group_resumes_with_no_callbacks_of_its_own():
    saved = OmegaConf.to_container(compose_train([]), resolve=True)
    assert isinstance(saved, dict) and saved.pop("callbacks") == {}
    assert parse(TrainSpec, saved).callbacks == {}
