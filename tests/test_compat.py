"""The private Lightning and torch APIs of xsa_lm.compat still behave as it expects, on the installed versions."""

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.strategies import ModelParallelStrategy

from xsa_lm import compat

VERSIONS = f"torch {torch.__version__}, lightning {L.__version__}"


def changed(api: str, what: str) -> str:
    return f"{api} {what} ({VERSIONS}): update xsa_lm/compat.py for this version"


class Recorder(L.LightningModule):
    """A linear model that records compat.should_update_logs at each training step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: dict[int, bool] = {}

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        self.seen[self.global_step] = compat.should_update_logs(self.trainer)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_should_update_logs_is_true_at_logging_steps(tmp_path: Path):
    api = "Trainer._logger_connector.should_update_logs"
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 2)), batch_size=1)
    trainer = L.Trainer(
        max_steps=6,
        log_every_n_steps=3,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    assert hasattr(trainer, "_logger_connector"), changed("Trainer._logger_connector", "is gone")
    assert hasattr(type(trainer._logger_connector), "should_update_logs"), changed(api, "is gone")
    module = Recorder()
    trainer.fit(module, data)
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
def test_model_parallel_strategy_keeps_save_distributed_checkpoint(sharded: bool):
    api = "ModelParallelStrategy._save_distributed_checkpoint"
    strategy = ModelParallelStrategy(save_distributed_checkpoint=sharded)
    assert hasattr(strategy, "_save_distributed_checkpoint"), changed(api, "is gone")
    assert compat.saves_sharded_checkpoints(strategy) is sharded, changed(api, "changed meaning")


def test_experiment_writer_checks_its_directory_from_init(tmp_path: Path):
    api = "ExperimentWriter._check_log_dir_exists"
    calls = []

    class Probe(ExperimentWriter):
        def _check_log_dir_exists(self) -> None:
            calls.append(self._fs)

    Probe(log_dir=str(tmp_path))
    assert calls, changed(api, "is no longer called from ExperimentWriter.__init__")
    assert calls[0] is not None, changed("ExperimentWriter._fs", "is not set before _check_log_dir_exists")


def test_csv_logger_appends_to_an_existing_metrics_file(tmp_path: Path):
    (tmp_path / "metrics.csv").write_text("step,train/loss\n0,1.5\n")
    logger = CSVLogger(save_dir=str(tmp_path), name="", version="")
    assert hasattr(logger, "_experiment"), changed("CSVLogger._experiment", "is gone")
    writer = compat.appending_csv_writer(logger)
    assert compat.appending_csv_writer(logger) is writer and logger.experiment is writer
    assert writer.metrics_keys == ["step", "train/loss"]
    writer.log_metrics({"train/loss": 1.25}, step=1)
    writer.save()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1"], changed("ExperimentWriter", "no longer appends to metrics.csv")


def test_a_distributed_checkpoint_reads_back_in_one_process_without_a_process_group(tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {"w": torch.arange(6.0).view(2, 3)}, "optimizer_0": {"step": torch.tensor(3.0)}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)  # the public writer, as FSDP2 runs write
    try:
        everything = compat.read_distributed_checkpoint(tmp_path)
        weights = compat.read_distributed_checkpoint(tmp_path, keys={"state_dict"})
    except (ImportError, TypeError, AttributeError) as e:
        pytest.fail(changed("torch.distributed.checkpoint._load_state_dict / _EmptyStateDictLoadPlanner", str(e)))
    assert torch.equal(everything["state_dict"]["w"], state["state_dict"]["w"]), changed("the DCP reader", "differs")
    assert torch.equal(everything["optimizer_0"]["step"], torch.tensor(3.0))
    assert set(weights) == {"state_dict"}, changed("_EmptyStateDictLoadPlanner(keys=)", "no longer filters")
