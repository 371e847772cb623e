"""Sharded checkpoints read in one process, their completeness checks and atomic replacement, and activation
checkpointing. Fast: a sharded checkpoint is written here by torch.distributed.checkpoint in a single process (the
same format as FSDP2's ranks write; the 2-process runs are in test_fsdp.py)."""

import warnings
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from tests.helpers import refused_in_process
from tests.test_reliability import run_ok
from xsa_lm.checkpoints.atomic import AtomicCheckpointIO, move_into_place
from xsa_lm.checkpoints.discovery import checkpoint_step, newest_valid_checkpoint
from xsa_lm.checkpoints.load import load_model
from xsa_lm.checkpoints.sharded import META, load_sharded
from xsa_lm.errors import UserError
from xsa_lm.model import GPT, GPTConfig
from xsa_lm.train import memory
from xsa_lm.train.module import param_groups

CONFIG = GPTConfig(n_layer=2, d_model=16, n_head=2, head_dim=8, vocab_size=64, block_size=8, attention="xsa")


def trained(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, fused=True)
    x = torch.randint(0, 64, (2, 8))
    model(x, x)[1].backward()
    optimizer.step()
    return model, optimizer


def write_sharded(path: Path, step: int, seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    """What AtomicModelParallelStrategy leaves: the tensors through torch.distributed.checkpoint (keys prefixed
    `model.` as the LightningModule's are), the rest in meta.pt."""
    model, optimizer = trained(seed)
    state = get_model_state_dict(model)
    optim = get_optimizer_state_dict(model, optimizer)
    prefix = lambda name: f"model.{name}"  # noqa: E731
    groups = [{**g, "params": [prefix(p) for p in g["params"]]} for g in optim["param_groups"]]
    optim = {"state": {prefix(k): v for k, v in optim["state"].items()}, "param_groups": groups}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": {prefix(k): v for k, v in state.items()}, "optimizer_0": optim}, checkpoint_id=path)
    torch.save({"global_step": step, "model_config": asdict(CONFIG)}, path / META)
    return model, optimizer


def test_a_sharded_checkpoint_reads_back_as_one_process_would_have_saved_it(tmp_path: Path):
    model, optimizer = write_sharded(tmp_path / "last.ckpt", step=7)
    checkpoint = load_sharded(tmp_path / "last.ckpt")
    assert checkpoint["global_step"] == 7
    for key, value in model.state_dict().items():
        assert torch.equal(checkpoint["state_dict"][f"model.{key}"], value)
    fresh = torch.optim.AdamW(param_groups(GPT(CONFIG), 0.1), lr=1e-3, fused=True)
    fresh.load_state_dict(checkpoint["optimizer_states"][0])  # positions, as a plain optimizer numbers them
    saved_states, restored_states = optimizer.state_dict()["state"], fresh.state_dict()["state"]
    for saved, restored in zip(saved_states.values(), restored_states.values(), strict=True):
        assert all(torch.equal(saved[k], restored[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    # Lightning's single-process resume reads it through the checkpoint plugin.
    via_io = AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert via_io.keys() == checkpoint.keys()
    # analyze / eval / generate: the weights only (torch.distributed.checkpoint's keyed reader, compat's)
    assert torch.equal(load_model(tmp_path / "last.ckpt").lm_head.weight, model.lm_head.weight)
    assert load_sharded(tmp_path / "last.ckpt", optimizer=False).keys() == checkpoint.keys() - {"optimizer_states"}


def test_resume_auto_skips_incomplete_sharded_checkpoints(tmp_path: Path):
    folder = tmp_path / "checkpoints"
    write_sharded(folder / "step-000010.ckpt", step=10)
    write_sharded(folder / "step-000020.ckpt", step=20)
    write_sharded(folder / "last.ckpt.tmp", step=30)  # a write cut short: never a candidate
    shard = next((folder / "step-000020.ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated (a copy cut short)
    assert checkpoint_step(folder / "step-000010.ckpt") == 10 and checkpoint_step(folder / "step-000020.ckpt") is None
    best, step, skipped = newest_valid_checkpoint(folder)
    assert (best, step, skipped) == (folder / "step-000010.ckpt", 10, [folder / "step-000020.ckpt"])
    with pytest.raises(UserError, match="incomplete sharded checkpoint"):
        load_model(folder / "step-000020.ckpt")
    (folder / "step-000010.ckpt" / META).unlink()  # rank 0's part missing
    assert checkpoint_step(folder / "step-000010.ckpt") is None


def test_a_sharded_checkpoint_is_replaced_whole(tmp_path: Path):
    """A directory cannot be renamed over another: the old one goes aside to .old first, and resume=auto still
    finds it there should a kill fall between the two renames."""
    folder = tmp_path / "checkpoints"
    write_sharded(folder / "last.ckpt", step=10)
    write_sharded(folder / "last.ckpt.tmp", step=20)
    move_into_place(folder / "last.ckpt.tmp", folder / "last.ckpt")
    assert checkpoint_step(folder / "last.ckpt") == 20 and sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]
    (folder / "last.ckpt").rename(folder / "last.ckpt.old")  # killed between the renames
    assert newest_valid_checkpoint(folder)[:2] == (folder / "last.ckpt.old", 20)
    # A file over a sharded directory and back (a resume that switches save_distributed_checkpoint).
    AtomicCheckpointIO().save_checkpoint({"global_step": 30}, folder / "last.ckpt.old")
    assert (folder / "last.ckpt.old").is_file() and checkpoint_step(folder / "last.ckpt.old") == 30


@pytest.mark.parametrize("attention", ["sa", "xsa"])
def test_activation_checkpointing_gives_the_same_gradients_with_less_memory(attention: str):
    """Measured with torch's MemTracker (every tensor's storage, live at the step's peak)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    config = GPTConfig(n_layer=4, d_model=64, n_head=2, head_dim=32, vocab_size=256, block_size=64, attention=attention)
    x, y = torch.randint(0, 256, (2, 8, 64), generator=torch.Generator().manual_seed(0))
    losses, grads, peaks = {}, {}, {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT(config)
        for block in model.blocks:
            block.activation_checkpointing = checkpointing
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            _, loss = model(x, y)
            loss.backward()
        losses[checkpointing], grads[checkpointing] = loss.item(), [p.grad for p in model.parameters()]
        peaks[checkpointing] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    assert losses[True] == losses[False]  # the recomputed forward is the same computation
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))
    activations = {c: sum(v for k, v in p.items() if str(k).endswith(("ACT", "TEMP"))) for c, p in peaks.items()}
    assert activations[True] < 0.5 * activations[False]
    for checkpointing in (False, True):  # the estimate that train's memory check and `xsa-lm plan` use
        e = memory.estimate(asdict(config), 256, 8, 64, "32-true", activation_checkpointing=checkpointing)
        assert 0.8 <= (e.activations + e.transient) / activations[checkpointing] <= 1.25


@pytest.mark.slow
@pytest.mark.long
def test_consolidate_writes_one_ordinary_checkpoint(tmp_path: Path, data_cache: Path):
    model, _ = write_sharded(tmp_path / "run" / "checkpoints" / "last.ckpt", step=12)
    source, out = tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "full.ckpt"
    proc = run_ok(["consolidate", f"ckpt={source}", f"out={out}"], data_cache, tmp_path)
    assert f"wrote {out}" in proc.stdout and "step 12" in proc.stdout
    assert checkpoint_step(out) == 12 and torch.equal(load_model(out).wte.weight, model.wte.weight)
    assert len(torch.load(out, weights_only=True)["optimizer_states"]) == 1  # resumable


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["ckpt=full.ckpt", "out=x.ckpt"], "ckpt: full.ckpt is a file, one checkpoint already"),
        (["ckpt=last.ckpt", "out=full.ckpt"], "out: full.ckpt exists; choose another path"),
        # `no` is a non-empty text: read as a truth value it would write a weights-only file
        (["ckpt=last.ckpt", "weights_only=no", "out=x.ckpt"], "weights_only=no must be true or false"),
        (["ckpt=last.ckpt", "weights_only=maybe", "out=x.ckpt"], "weights_only=maybe must be true or false"),
    ],
)
def test_consolidate_refusals(args: list[str], expected: str, tmp_path: Path, monkeypatch, capsys):
    write_sharded(tmp_path / "last.ckpt", step=3)
    (tmp_path / "full.ckpt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert refused_in_process(["consolidate", *args], monkeypatch, capsys).startswith(f"xsa-lm: error: {expected}")
    assert not (tmp_path / "x.ckpt").exists()
