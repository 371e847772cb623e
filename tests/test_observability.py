"""In-training observability: step time, tokens/s and MFU in metrics.csv at logging steps, and a torch.profiler trace
of a chosen range of optimizer steps."""

import json
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import FAST
from tests.helpers import compose_train
from tests.test_reliability import run_ok
from xsa_lm.compat import QUIET_TRAINER
from xsa_lm.config.spec import VALUES_ONLY, TrainSpec, parse
from xsa_lm.errors import UserError
from xsa_lm.files import read_csv
from xsa_lm.model import GPTConfig
from xsa_lm.train.callbacks import Profiler, Throughput
from xsa_lm.train.module import LMModule
from xsa_lm.train.schedule import warmup_cosine_scheduler

CONTEXT, VOCAB = 32, 128


def fit(callbacks: list[L.Callback], max_steps: int, accumulate: int = 2) -> LMModule:
    """A tiny LMModule trained by a real Lightning Trainer on random tokens."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, d_model=32, n_head=2, head_dim=16, vocab_size=VOCAB, block_size=CONTEXT)
    scheduler = partial(warmup_cosine_scheduler, warmup_steps=1, min_lr_ratio=0.1)
    module = LMModule(config, partial(torch.optim.AdamW, lr=1e-3), scheduler, max_steps, spike_factor=None)
    tokens = torch.randint(0, VOCAB, (64, CONTEXT + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=max_steps, accumulate_grad_batches=accumulate, callbacks=callbacks, **QUIET_TRAINER
    )
    trainer.fit(module, train_dataloaders=loader)
    return module


def trace_names(path: Path) -> list[str]:
    return [event.get("name", "") for event in json.loads(path.read_text())["traceEvents"]]


def test_profiler_traces_the_asked_optimizer_steps(tmp_path: Path):
    profiler = Profiler(run_dir=str(tmp_path), start_step=1, steps=2)
    fit([profiler], max_steps=5)
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["steps_1-2_rank0.json"]
    names = trace_names(profiler.path)
    assert sum(name.startswith("Optimizer.step#AdamW") for name in names) == 2  # steps 1 and 2, not 0, 3 or 4
    assert names.count("aten::scaled_dot_product_attention") == 2 * 2 * 2  # layers x micro-batches x steps
    assert "aten::layer_norm" in names and any(name in ("aten::mm", "aten::addmm") for name in names)


def test_a_run_ending_inside_the_range_writes_what_it_traced(tmp_path: Path):
    profiler = Profiler(run_dir=str(tmp_path), start_step=2, steps=10)
    fit([profiler], max_steps=3, accumulate=1)
    assert profiler.path == tmp_path / "profile" / "steps_2-2_rank0.json"
    assert sum(name.startswith("Optimizer.step#AdamW") for name in trace_names(profiler.path)) == 1


def test_throughput_reads_flops_and_peak_at_the_start(tmp_path: Path):
    throughput = Throughput(tokens_per_step=2 * 4 * CONTEXT)
    module = fit([throughput], max_steps=3)
    assert throughput.flops_per_token == module.model.flops_per_token(CONTEXT) > 0
    assert throughput.peak_flops > 0  # a measured matmul on CPU
    metrics = throughput.metrics(3, torch.device("cpu"))
    assert metrics["train/step_time_s"] > 0 and 0 < metrics["train/mfu"] < 1
    assert metrics["train/tokens_per_s"] == pytest.approx(throughput.tokens_per_step / metrics["train/step_time_s"])
    assert not any("memory" in key for key in metrics)  # CUDA's allocator counters only
    one_step = Throughput(tokens_per_step=4 * CONTEXT)
    fit([one_step], max_steps=1, accumulate=1)  # timed from the start of training: a rate, not 0 tokens/s
    assert one_step.step_time_s > 0
    assert one_step.tokens_per_s == pytest.approx(one_step.tokens_per_step / one_step.step_time_s)


@pytest.mark.parametrize("override", ["profile.steps=0", "profile.start_step=-1", "profile.start_step=1.5"])
def test_bad_profile_values_are_refused(override: str):
    with pytest.raises(UserError, match=override.split("=")[0]):
        parse(TrainSpec, compose_train([override]), VALUES_ONLY)


@pytest.mark.slow
def test_train_logs_step_time_and_mfu_at_logging_steps(data_cache: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    args = ["train", *FAST, "trainer.max_steps=8", "trainer.log_every_n_steps=2", "val_every_steps=8"]
    run_ok([*args, f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    rows = [row for row in read_csv(run_dir / "metrics.csv")[1] if row.get("train/loss")]
    assert [int(row["step"]) for row in rows] == [1, 3, 5, 7]  # logging steps only
    timed = [row for row in rows if row["train/step_time_s"]]
    assert len(timed) >= 3 and all(row["train/mfu"] for row in timed)
    assert all(float(row["train/step_time_s"]) > 0 and 0 < float(row["train/mfu"]) < 1 for row in timed)
    assert "train/max_memory_allocated_gib" not in rows[0]  # CPU run
