"""A lab's own Lightning callbacks from config (the `callbacks` group): built after xsa-lm's own, which stay as they
were; a `_target_` that cannot be a callback is refused in one line before the run folder is made."""

import json
import os
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from tests.helpers import FAST, assert_nothing_written, assert_refused, compose_train, run_cli
from xsa_lm.checkpoints.atomic import AsyncSave, FolderCheckpoint
from xsa_lm.config.spec import TrainSpec, parse
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
from xsa_lm.train.cluster import ClusterChecks
from xsa_lm.train.run import make_callbacks

BUILT_IN = [ClusterChecks, AttentionKernels, FolderCheckpoint, FolderCheckpoint, ValHistory, Throughput, Preemption]
BUILT_IN += [SavedConfig]
OPTIONAL = ["diagnostics.every_n_steps=5", "samples.every_n_steps=5", "profile.start_step=2"]
ASYNC = ["trainer=fsdp", "trainer.strategy.save_distributed_checkpoint=true", "checkpoint.async_save=true"]


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
        ([f"+callbacks.mine._target_={__name__}.Marker", "+callbacks.mine.note=hi"], [*BUILT_IN, ProgressBar, Marker]),
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
from omegaconf import OmegaConf


class Mark(Callback):
    def __init__(self, path, note):
        self.path, self.note = path, note

    def on_train_end(self, trainer, pl_module):
        with open(self.path, "w") as f:
            json.dump({"note": self.note, "step": trainer.global_step}, f)
"""


def test_a_labs_callbacks_run_from_its_package_and_its_config_folder(data_cache: Path, tmp_path: Path):
    """One from a file in the lab's --config-dir (`callbacks=[default,mine]`), one from the command line only."""
    lab, run_dir = tmp_path / "lab", tmp_path / "run"
    (lab / "lab_callbacks").mkdir(parents=True)
    (lab / "lab_callbacks" / "__init__.py").write_text(MARK)
    (lab / "configs" / "callbacks").mkdir(parents=True)
    (lab / "configs" / "callbacks" / "mine.yaml").write_text(
        f"mine:\n  _target_: lab_callbacks.Mark\n  path: {tmp_path / 'from_file.json'}\n  note: file\n"
    )
    args = ["train", "--config-dir", str(lab / "configs"), "callbacks=[default,mine]", *FAST, "trainer.max_steps=3"]
    args += ["+callbacks.cli._target_=lab_callbacks.Mark", f"+callbacks.cli.path={tmp_path / 'from_cli.json'}"]
    args += ["+callbacks.cli.note=cli", f"hydra.run.dir={run_dir}"]
    pythonpath = os.pathsep.join([str(lab), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = run_cli(args, data_cache, tmp_path, PYTHONPATH=pythonpath)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    for name in ("file", "cli"):
        assert json.loads((tmp_path / f"from_{name}.json").read_text()) == {"note": name, "step": 3}


@pytest.mark.parametrize(
    "target, said",
    [
        ("lab_nowhere.Mark", "callbacks.mine._target_=lab_nowhere.Mark cannot be imported (No module named"),
        ("xsa_lm.NoSuchCallback", "=xsa_lm.NoSuchCallback cannot be imported (module 'xsa_lm' has no attribute"),
        ("collections.OrderedDict", "=collections.OrderedDict is not a Lightning Callback class"),
        ("Mark", "callbacks.mine._target_=Mark must name a class by its module"),
    ],
)
def test_a_callback_that_cannot_be_built_is_refused_before_the_run_folder(
    target: str, said: str, data_cache: Path, tmp_path: Path
):
    run_dir = tmp_path / "run"
    args = ["train", *FAST, f"+callbacks.mine._target_={target}", f"hydra.run.dir={run_dir}"]
    assert_refused(run_cli(args, data_cache, tmp_path), said)
    assert_nothing_written(run_dir)


def test_a_config_saved_before_the_group_resumes_with_no_callbacks_of_its_own():
    saved = OmegaConf.to_container(compose_train([]), resolve=True)
    assert isinstance(saved, dict) and saved.pop("callbacks") == {}
    assert parse(TrainSpec, saved).callbacks == {}
