"""The CUDA path's combination rehearsed on CPU through `xsa-lm train`: torch.compile (fullgraph=True: a graph break
is an error) + XSA's custom ops + FSDP2 on 2 gloo ranks (fp32 parameters) + bf16-mixed, and a resume."""

import math
from pathlib import Path

import pytest

from tests.helpers import FAST, train_losses
from tests.test_reliability import run_ok

# Run by make test-torch-floor, on the GPU machine's torch (2.11), not again by make test-long on 2.13 (~4.5 min).
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.torch_floor]
ARGS = [a for a in FAST if a != "trainer=cpu"] + "attention=xsa compile=true data.val_windows=16".split()
ARGS += "trainer=fsdp trainer.accelerator=cpu trainer.devices=2 trainer.precision=bf16-mixed".split()
# a checkpoint after each validation: step 3's is the one resumed
ARGS += "trainer.max_steps=6 scheduler.total_steps=6 val_every_steps=3".split()


def generated_code(cache_dir: Path) -> str:
    """The wrapper code inductor generated (its cache holds it beside the kernels)."""
    return "\n".join(code.read_text(errors="replace") for code in cache_dir.rglob("*.py"))


def test_compiled_xsa_under_fsdp2_in_bf16_trains_and_resumes_where_it_left_off(data_cache: Path, tmp_path: Path):
    """6 steps on 2 ranks, then a run resumed from step 3's sharded checkpoint: finite losses, and steps 3-5 as the
    uninterrupted run's (measured equal to the last bit; allowed 1e-5 relative, as tests/test_fsdp.py)."""
    inductor = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # this test's kernels, compiled afresh
    first = run_ok(["train", *ARGS, f"hydra.run.dir={tmp_path / 'run'}"], data_cache, tmp_path, **inductor)
    assert "bfloat16 Automatic Mixed Precision" in first.stderr and "x 2 device(s)" in first.stdout
    # the compiled code calls XSA's ops forward and backward, as they are
    code = generated_code(tmp_path / "inductor")
    assert "xsa_lm.exclusive_output_projection" in code and "xsa_lm.exclusive_backward" in code
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == list(range(6)) and all(math.isfinite(loss) for loss in losses.values())

    checkpoint = tmp_path / "run" / "checkpoints" / "step-000003.ckpt"
    resume = [*ARGS, f"resume={checkpoint}", f"hydra.run.dir={tmp_path / 'resumed'}"]
    resumed = run_ok(["train", *resume], data_cache, tmp_path, **inductor)
    assert f"starts from {checkpoint} (step 3)" in resumed.stdout
    continued = train_losses(tmp_path / "resumed")
    assert sorted(continued) == [3, 4, 5]
    for step, loss in continued.items():
        assert loss == pytest.approx(losses[step], rel=1e-5), step
