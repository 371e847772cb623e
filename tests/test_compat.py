"""What xsa_lm.compat relies on still holds on the installed versions: the private Lightning and torch APIs it uses
behave as it expects, and the Lightning and Hydra rules it restates in public terms give their own answers."""

from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from xsa_lm import compat
from xsa_lm.files import read_csv
from xsa_lm.tracking import RunCSVLogger

VERSIONS = f"torch {torch.__version__}, lightning {L.__version__}"


def changed(api: str, what: str) -> str:
    return f"{api} {what} ({VERSIONS}; checked against {compat.CHECKED_AGAINST}): update xsa_lm/compat.py for it"


class Recorder(L.LightningModule):
    """A linear model that records compat.should_update_logs by step and compat.accumulating by micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: dict[int, bool] = {}
        self.accumulating: dict[int, bool] = {}

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        self.seen[self.global_step] = compat.should_update_logs(self.trainer)
        self.accumulating[batch_idx] = compat.accumulating(self.trainer)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_on_ones(
    module: L.LightningModule, tmp_path: Path, *, rows: int = 8, ckpt_path=None, validate=False, **settings
) -> L.Trainer:
    """`module` fitted on `rows` batches of ones (validated on them too) by a Trainer that writes nothing but what
    `settings` ask for."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(rows, 2)), batch_size=1)
    trainer = L.Trainer(default_root_dir=tmp_path, **{**compat.QUIET_TRAINER, **settings})
    trainer.fit(module, data, data if validate else None, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("accumulate", [1, 2])
def test_should_update_logs_is_lightnings_rule(tmp_path: Path, accumulate: int):
    api = "Trainer._logger_connector.should_update_logs"
    settings = dict(max_steps=6, log_every_n_steps=3, accumulate_grad_batches=accumulate, logger=CSVLogger(tmp_path))
    module = fit_on_ones(Recorder(), tmp_path, rows=16, **settings).lightning_module
    assert module.seen == {0: False, 1: False, 2: True, 3: False, 4: False, 5: True}, changed(api, "changed meaning")


def test_fused_adamw_skips_its_update_where_found_inf_is_set():
    api = "fused AdamW's optimizer.found_inf"
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.ones(3)
    compat.skip_fused_update(optimizer, torch.tensor(True))
    optimizer.step()
    assert torch.equal(weight.detach(), torch.ones(3)), changed(api, "no longer skips the update")
    compat.skip_fused_update(optimizer, torch.tensor(False))
    optimizer.step()
    assert not torch.equal(weight.detach(), torch.ones(3)), changed(api, "blocks every update")


@pytest.mark.parametrize("sharded", [True, False])
def test_the_sharded_strategy_knows_whether_it_saves_shards(sharded: bool):
    from xsa_lm.checkpoints.atomic import AtomicModelParallelStrategy

    strategy = AtomicModelParallelStrategy(save_distributed_checkpoint=sharded)
    assert strategy.sharded is sharded and strategy._save_distributed_checkpoint is sharded


def test_experiment_writer_checks_its_directory_from_init(tmp_path: Path):
    api = "ExperimentWriter._check_log_dir_exists"
    calls = []

    class Probe(ExperimentWriter):
        def _check_log_dir_exists(self) -> None:
            calls.append(self._fs)

    Probe(log_dir=str(tmp_path))
    assert calls, changed(api, "is no longer called from ExperimentWriter.__init__")


def test_csv_logger_appends_to_an_existing_metrics_file(tmp_path: Path):
    (tmp_path / "metrics.csv").write_text("step,train/loss\n0,1.5\n")
    logger = RunCSVLogger(save_dir=str(tmp_path))
    writer = logger.experiment
    assert isinstance(writer, compat.AppendingExperimentWriter) and logger.experiment is writer
    writer.log_metrics({"train/loss": 1.25}, step=1)
    writer.save()
    writer.log_metrics({"train/lr": 0.5}, step=2)  # a new column: the header is rewritten, the rows kept
    writer.save()
    rows = read_csv(tmp_path / "metrics.csv")[1]
    assert [r["step"] for r in rows] == ["0", "1", "2"], changed("ExperimentWriter", "no longer appends to metrics.csv")
    assert rows[0] == {"step": "0", "train/loss": "1.5", "train/lr": ""} and rows[2]["train/lr"] == "0.5"


def fit_recorder(tmp_path: Path, callbacks: list, ckpt_path: str | None = None, steps: int = 4) -> L.Trainer:
    settings = dict(max_steps=steps, callbacks=callbacks, enable_checkpointing=True, limit_val_batches=0)
    return fit_on_ones(Recorder(), tmp_path, ckpt_path=ckpt_path, **settings)


def test_model_checkpoint_saves_now_on_request(tmp_path: Path, monkeypatch):
    """compat.save_checkpoints_now writes the top-k and last checkpoints outside a validation, through
    Trainer.save_checkpoint (where LinkingTrainer writes a step's payload once)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    api = "ModelCheckpoint._save_topk_checkpoint / _save_last_checkpoint"
    keep = partial(ModelCheckpoint, filename="step-{step}", monitor="step", mode="max", save_last=True)
    trainer = fit_recorder(tmp_path, [keep(dirpath=tmp_path)])
    trainer.state.fn = "validate"  # as after trainer.validate
    seen, save = [], trainer.save_checkpoint
    monkeypatch.setattr(
        trainer, "save_checkpoint", lambda path, *args: seen.append(Path(path).name) or save(path, *args)
    )
    compat.save_checkpoints_now(keep(dirpath=tmp_path / "now"), trainer)
    assert sorted(p.name for p in (tmp_path / "now").iterdir()) == ["last.ckpt", "step-step=4.ckpt"], changed(
        api, "changed"
    )
    assert seen == ["step-step=4.ckpt", "last.ckpt"], changed(api, "no longer saves through Trainer.save_checkpoint")


def test_the_resume_checkpoint_can_be_agreed_on_before_it_is_read(tmp_path: Path):
    api = "_CheckpointConnector._restore_modules_and_callbacks"
    first = fit_recorder(tmp_path / "a", [], steps=3)
    saved = tmp_path / "rank0.ckpt"
    first.save_checkpoint(saved)
    offered = []

    class Agree(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            compat.agree_on_resume_checkpoint(trainer, lambda path: offered.append(path) or str(saved))

    resumed = fit_recorder(tmp_path / "b", [Agree()], ckpt_path=None, steps=5)  # this rank found none
    assert offered == [None], changed(api, "is not where fit hands over ckpt_path")
    assert resumed.ckpt_path == str(saved) and resumed.global_step == 5, changed(api, "no longer restores the path")


def test_lightning_broadcasts_a_sigterm_flag_per_batch_that_can_be_skipped(tmp_path: Path, monkeypatch):
    """The per-micro-batch broadcast only happens with several processes: checked here in the loop's code, and
    counted in a 2-process run by tests/test_multi_device.py."""
    import inspect

    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    api = "_TrainingEpochLoop._broadcast_sigterm_tensor"
    assert hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"), changed(api, "is gone")
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance), changed(
        api, "is no longer called from _TrainingEpochLoop.advance"
    )
    broadcasts = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda tensor, src: broadcasts.append(src))
    trainer = L.Trainer(logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert broadcasts == [0], changed(api, "no longer broadcasts through torch.distributed.broadcast")
    compat.skip_sigterm_broadcast(trainer)
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert broadcasts == [0], changed(api, "can no longer be skipped")


def test_accumulating_is_true_except_on_the_last_micro_batch_of_each_step(tmp_path: Path):
    api = "Trainer.fit_loop._should_accumulate"
    module = fit_on_ones(Recorder(), tmp_path, rows=7, max_epochs=1, accumulate_grad_batches=3).lightning_module
    expected = {0: True, 1: True, 2: False, 3: True, 4: True, 5: False, 6: False}  # the epoch's last batch steps
    assert module.accumulating == expected, changed(api, "changed meaning")


def test_lightning_names_precisions_and_decides_device_settings_as_its_trainer_does():
    api = "lightning.fabric's precision names (_PRECISION_INPUT_STR, _convert_precision_to_unified_args)"
    assert "bf16-mixed" in compat.PRECISIONS and "32-true" in compat.PRECISIONS, changed(api, "changed")
    for given, name in (("16", "16-mixed"), ("bf16", "bf16-mixed"), (32, "32-true"), ("64", "64-true")):
        assert compat.lightning_precision_name(given) == name, changed(api, "changed")
    for bogus in ("bogus", "fp8", 8):
        with pytest.raises(ValueError):
            compat.lightning_precision_name(bogus)
    for precision in ("32-true", "16-mixed"):  # what the Trainer then trains in
        trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, logger=False, enable_progress_bar=False)
        decided = compat.lightning_device_settings(accelerator="cpu", devices=1, precision=precision)
        assert decided == trainer.precision
    with pytest.raises(MisconfigurationException, match="devices=0"):  # as Trainer(devices=0) raises
        compat.lightning_device_settings(accelerator="cpu", devices=0)


def test_a_compiled_model_names_its_weights_with_the_wrapper_prefix():
    compiled = torch.compile(torch.nn.Linear(2, 2))  # wrapped, not compiled until called
    assert all(key.startswith(compat.COMPILED_PREFIX) for key in compiled.state_dict()), changed(
        "torch.compile's OptimizedModule._orig_mod", "changed"
    )


class StepLogger(Recorder):
    """Logs its loss at every step and validates on one batch; a checkpoint it resumes from is set as after a train
    batch's end (compat.resume_after_the_step), as LMModule sets it."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).sum()
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val", self.layer(batch[0]).sum())

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        compat.resume_after_the_step(checkpoint, global_step=checkpoint["global_step"])


@pytest.mark.parametrize("saved", ["at a validation's end", "after the fit"])
def test_a_resumed_run_numbers_its_logged_rows_by_step_whether_or_not_it_validates_there(tmp_path: Path, saved: str):
    """The step Lightning's loggers number rows by is restored from the checkpoint's loop counters: set as after a
    train batch's end, it is counted on restore, whatever the resumed run validates at."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    api = "the loop counters of a checkpoint (`loops.fit_loop`, `epoch_loop.state_dict._batches_that_stepped`)"

    def fit(folder: str, steps: int, validate_every: int, ckpt_path: str | None = None, **settings) -> list[int]:
        settings |= dict(max_steps=steps, val_check_interval=validate_every, limit_val_batches=1, log_every_n_steps=1)
        logger = CSVLogger(tmp_path, name=folder, version="")
        trainer = fit_on_ones(StepLogger(), tmp_path, ckpt_path=ckpt_path, validate=True, logger=logger, **settings)
        if ckpt_path is None:
            trainer.save_checkpoint(tmp_path / "after.ckpt")
        return [int(row["step"]) for row in read_csv(Path(logger.log_dir, "metrics.csv"))[1] if row["loss"]]

    keep = ModelCheckpoint(dirpath=tmp_path, filename="at-{step}", every_n_train_steps=None, save_top_k=-1)
    assert fit("first", 3, 3, callbacks=[keep], enable_checkpointing=True) == [0, 1, 2]
    checkpoint = tmp_path / ("at-step=3.ckpt" if saved == "at a validation's end" else "after.ckpt")
    for validate_every in (1, 2):  # the resumed run validates at step 3 (as the first did), or not
        resumed = fit(f"resumed-{validate_every}", 5, validate_every, ckpt_path=str(checkpoint))
        assert resumed == [3, 4], changed(api, f"changed (resumed from a checkpoint saved {saved}: rows {resumed})")


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_stop_before_the_last_micro_batch_is_logged_and_validated_in_the_loop(tmp_path: Path, accumulate: int):
    """LMModule stops the loop as its last micro-batch starts (Trainer.should_stop), so that Lightning logs that step
    and validates it inside the loop, with its own row numbers and checkpoint hooks, though it is on neither's grid."""
    api = "Trainer.should_stop set in on_train_batch_start (_TrainingEpochLoop._should_check_val_fx)"
    logger = CSVLogger(tmp_path, name="run", version="")

    class StopsAtTheEnd(StepLogger):
        def on_train_batch_start(self, *args) -> None:
            if self.global_step + 1 >= self.trainer.max_steps and not compat.accumulating(self.trainer):
                self.trainer.should_stop = True

    settings = dict(val_check_interval=2 * accumulate, accumulate_grad_batches=accumulate, log_every_n_steps=2)
    settings |= dict(max_steps=3, logger=logger, limit_val_batches=1)
    trainer = fit_on_ones(StopsAtTheEnd(), tmp_path, rows=16, validate=True, **settings)
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == 3 * accumulate, changed(api, "stops early")
    rows = read_csv(Path(logger.log_dir, "metrics.csv"))[1]
    validated, logged = [r["step"] for r in rows if r["val"]], [r["step"] for r in rows if r["loss"]]
    assert validated == ["1", "2"] and logged == ["1", "2"], changed(api, f"changed (rows {validated}, {logged})")
