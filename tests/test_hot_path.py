"""The training hot path reads nothing back from the device between logging steps (no host-device syncs)."""

import subprocess
import sys
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.helpers import FAST, compose_train, train_from
from xsa_lm.train import run

# Every way a tensor's value reaches Python; on a GPU each one waits for the device to finish its queue.
READS = ("item", "tolist", "__bool__", "__float__", "__int__")
LOG_EVERY = 5


@pytest.mark.slow
def test_no_value_is_read_back_between_logging_steps(data_cache: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("XSA_LM_DATA_DIR", str(data_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    overrides = "trainer.max_steps=20 val_every_steps=10 progress_bar=true logger=csv".split()
    cfg = compose_train([*FAST, f"trainer.log_every_n_steps={LOG_EVERY}", *overrides])
    reads: list[str] = []
    step_starts: list[tuple[int, int]] = []  # (global step, reads so far) at each batch start

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "xsa_lm/data" not in caller and "torch/utils/data" not in caller:  # CPU-side data loading is fine
                reads.append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
            return original(self, *args, **kwargs)

        return read

    class StepMarks(run.Throughput):
        def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
            step_starts.append((trainer.global_step, len(reads)))

    monkeypatch.setattr(run, "Throughput", StepMarks)
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    summary = train_from(cfg, tmp_path / "run")
    monkeypatch.undo()

    assert summary is not None and summary.status == "completed" and len(step_starts) == 40  # 2 micro-batches per step
    first = {step: count for step, count in reversed(step_starts)}  # reads before each step's first micro-batch
    per_step = {step: reads[first[step] : first[step + 1]] for step in range(19)}
    quiet = {step: r for step, r in per_step.items() if (step + 1) % LOG_EVERY}
    assert len(quiet) == 16 and all(not r for r in quiet.values()), {s: Counter(r) for s, r in quiet.items() if r}
    logging = [per_step[step] for step in per_step if (step + 1) % LOG_EVERY == 0]
    assert any(logging)  # and the counter does see reads: at logging steps the loss is written out


def test_freed_host_memory_is_reused_instead_of_page_faulted_in_again():
    """glibc unmaps each freed block above its mmap threshold: every 32 MiB tensor page-faults in anew, every step."""
    script = """
import resource, torch
from xsa_lm.train.host_memory import reuse_freed_host_memory
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.ones(8 * 2**20)  # 32 MiB, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
default = faults()
applied = reuse_freed_host_memory()
faults()  # the heap grows once
print(default, applied, faults())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    default, applied, reused = int(out[0]), out[1] == "True", int(out[2])
    assert applied  # this machine has glibc
    assert default > 10 * 8000 and reused < 100  # 8192 pages of 4 KiB per 32 MiB tensor, then none
