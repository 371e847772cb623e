"""A training config is checked as a whole before anything is written (the trainer as Lightning takes it here), and
what a run reports is what it does (the warmup it can finish, the LR it reached, its sinks' memory). No training."""

import sys
from pathlib import Path
from types import SimpleNamespace

import hydra
import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from tests.helpers import FAST, compose_train, refused_in_process, train_from
from tests.test_plan import plan_of
from xsa_lm import cli
from xsa_lm.config.builders import check_trainer
from xsa_lm.config.command_line import flags_first
from xsa_lm.config.spec import TrainSpec, parse
from xsa_lm.errors import UserError
from xsa_lm.train import memory
from xsa_lm.train.run import fewer_windows, trainer_strategy
from xsa_lm.train.schedule import peak_lr

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there: Lightning can use it")


def fast_config(*overrides: str) -> DictConfig:
    """FAST with the overrides; a trainer option replaces FAST's trainer=cpu."""
    own_trainer = any(o.startswith("trainer=") for o in overrides)
    return compose_train([*(a for a in FAST if not (own_trainer and a.startswith("trainer="))), *overrides])


def fast(*overrides: str) -> TrainSpec:
    return parse(TrainSpec, fast_config(*overrides))


REFUSED = {  # what Lightning refuses on this machine (the spec's own rules: test_schema.py)
    "fp16 autocast on CPU": (["trainer.precision=16-mixed"], "Lightning would train in bf16-mixed"),
    "fp16 autocast on CPU, by its alias": (["trainer.precision=16"], "trainer.precision=16: Lightning would train"),
    "an accelerator Lightning lacks here": (["trainer.accelerator=tpu"], "trainer.accelerator=tpu: Lightning cannot"),
    "device indices on CPU": (["trainer.devices=[0,1]"], "trainer.devices=[0, 1]: Lightning cannot train so"),
    "no GPU for trainer=gpu": pytest.param(["trainer=gpu"], "trainer.accelerator=gpu: Lightning", marks=NO_GPU),
    "no GPU for trainer=fsdp": pytest.param(["trainer=fsdp"], "trainer.accelerator=gpu: Lightning", marks=NO_GPU),
}


@pytest.mark.parametrize("overrides, expected", REFUSED.values(), ids=REFUSED.keys())
def test_refused_before_anything_is_written(
    overrides: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(sys, "argv", ["xsa-lm", "train"])  # train() records the command line in sys.argv
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # as Hydra makes it
    with pytest.raises(UserError) as refused:
        train_from(fast_config(*overrides), run_dir)
    assert expected in str(refused.value) and "\n" not in str(refused.value), refused.value
    assert list(run_dir.iterdir()) == []  # no config.yaml, run_info.json or train.log


@pytest.mark.parametrize(
    "overrides, precision",
    [
        ([], "32-true"),  # trainer=cpu
        (["trainer=default", "trainer.accelerator=cpu"], "32-true"),  # precision auto, resolved
        (["trainer.precision=bf16"], "bf16-mixed"),  # Lightning's alias, by its full name
        (["trainer.precision=bf16-mixed", "trainer.devices=2", "global_batch_tokens=2048"], "bf16-mixed"),  # DDP
        # docs/gpus.md's FSDP2 on CPU
        (["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"], "32-true"),
    ],
)
def test_settings_lightning_takes_here_pass(overrides: list[str], precision: str):
    trainer = fast(*overrides).trainer
    assert check_trainer(trainer, strategy=trainer_strategy(trainer)) == precision == trainer.resolved_precision


def test_a_warmup_longer_than_the_schedule_is_clipped_with_a_warning():
    short = fast("trainer.max_steps=3")  # FAST warms up for 5 steps
    warning = short.schedule.warning
    assert warning and "scheduler.warmup_steps=5" in warning and "clipped to 3" in warning and "\n" not in warning
    assert (short.scheduler_node["warmup_steps"], short.scheduler_node["total_steps"]) == (3, 3)  # config.yaml's
    assert peak_lr(scheduler_of(short), steps=3) == pytest.approx(short.optim.lr)  # reached at the last step
    unclipped = fast("trainer.max_steps=3", "scheduler.total_steps=3")
    assert peak_lr(scheduler_of(unclipped, settled=False), steps=3) == pytest.approx(short.optim.lr * 3 / 5)
    longer = fast("trainer.max_steps=6", "scheduler.total_steps=2")  # a schedule shorter than the run
    lr = longer.optim.lr
    assert "the 4 steps after it run at its final LR" in str(longer.schedule.warning)
    assert [lr * f(step) for f in scheduler_of(longer).lr_lambdas for step in range(6)] == pytest.approx(
        [lr / 2, lr] + [lr * longer.scheduler.min_lr_ratio] * 4
    )
    whole = fast()
    assert whole.schedule.warning is None and whole.schedule.warmup_steps == 5
    assert peak_lr(scheduler_of(whole), steps=40) == pytest.approx(whole.optim.lr)
    assert peak_lr(scheduler_of(whole), steps=0) is None
    # Stopping early inside a longer schedule is deliberate (a resume continues it): left as set.
    inside = fast("trainer.max_steps=2", "scheduler.total_steps=40")
    assert inside.schedule.warning is None and inside.schedule.warmup_steps == 5


def scheduler_of(spec: TrainSpec, settled: bool = True) -> torch.optim.lr_scheduler.LRScheduler:
    """The run's scheduler, as make_module builds it (settled=False: as the config gives it, unclipped)."""
    optimizer = hydra.utils.instantiate(spec.optim.node)([torch.nn.Parameter(torch.zeros(2))])
    node = spec.scheduler_node if settled else spec.scheduler.model_dump(by_alias=True)
    return hydra.utils.instantiate(node)(optimizer, total_steps=spec.schedule.total_steps)


def test_sinks_count_in_the_memory_estimate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    model = {"n_layer": 4, "d_model": 128, "n_head": 4, "head_dim": 32, "mlp_ratio": 4}
    sinks = {**model, "n_sinks": 4}
    plain, with_sinks = (memory.estimate(m, 4096, 16, 128, "32-true") for m in (model, sinks))
    per_position = model["n_layer"] * sum(memory.block_saved_per_token(model, compute=4, residual=4).values())
    assert with_sinks.activations - plain.activations == 16 * 4 * per_position  # 4 more positions per sequence
    assert memory.parameter_count(sinks, 4096) == memory.parameter_count(model, 4096) + 4 * 128
    (plan, text), (without, _) = (
        plan_of(["model=tiny", *extra, "device_memory_gb=80"], tmp_path, monkeypatch, capsys)
        for extra in (["model.n_sinks=64"], [])
    )
    assert plan["per_device_bytes"] != without["per_device_bytes"] and "64 attention sinks" in text
    error = refused_in_process(["plan", "model.n_sinks=100000"], monkeypatch, capsys)
    assert "model.n_sinks=100000 must be in [0, block_size=128]" in error


def test_the_readme_plan_says_why_its_batch_does_not_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    readme = ["model=paper_2.7b", "trainer=fsdp", "trainer.devices=8", "micro_batch_size=8", "device_memory_gb=80"]
    _, text = plan_of(readme, tmp_path, monkeypatch, capsys)
    assert "None" not in text
    assert "global_batch_tokens=16,384 is not a multiple of" in text and "8 x 8 x 2048 = 131,072" in text
    _, paper = plan_of([*readme, "global_batch_tokens=524288"], tmp_path, monkeypatch, capsys)
    assert "global_batch_tokens=524,288: 4 micro-batch(es) of 131,072 tokens per optimizer step" in paper


def test_more_windows_than_the_data_holds_are_named():
    data = SimpleNamespace(val_available=12, val_set=SimpleNamespace(n=12))
    notes = fewer_windows(fast("data.val_windows=100", "diagnostics.every_n_steps=5", "diagnostics.sequences=50"), data)
    assert notes == [
        "WARNING: data.val_windows=100 but the validation split holds 12 windows of 65 tokens: validating on all "
        "of them",
        "WARNING: diagnostics.sequences=50 but validation uses 12 windows: the diagnostics measure 12",
    ]
    assert fewer_windows(fast("data.val_windows=12"), data) == []


def test_a_flag_between_overrides_is_taken(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """argparse refuses a flag between overrides with its whole usage text; the user meant the same command."""
    assert flags_first(["seed=1", "--cfg", "job", "lr=2", "-m", "a=b"]) == "--cfg job -m seed=1 lr=2 a=b".split()
    assert flags_first(["x=1", "--info", "defaults", "y=2"]) == ["--info", "defaults", "x=1", "y=2"]
    assert flags_first(["x=1", "--info", "y=2"]) == ["--info", "x=1", "y=2"]
    monkeypatch.setattr(sys, "argv", ["xsa-lm", "train", "seed=3", "--cfg", "job", "trainer.max_steps=7"])
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # restored after: this job's config does not linger
    cli.main()  # prints the config, as with the flag first
    printed = capsys.readouterr().out
    assert "seed: 3" in printed and "max_steps: 7" in printed


def test_every_device_on_cpu_is_lightnings_one(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert fast("trainer=default", "trainer.devices=auto", "global_batch_tokens=4096").trainer.world_size == 8
    assert fast("trainer.devices=auto").trainer.world_size == 1  # trainer=cpu: Lightning's CPU "auto" is one
