"""Many devices without wasted work: each rank's GPU set before any CUDA call, no host sync per micro-batch, one
gradient reduction per optimizer step under FSDP2, and a compile that covers the head and the loss under FSDP2. The
multi-process checks run this file in 2 gloo processes started as torchrun would, each counting what it calls."""

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port as free_port

from tests.helpers import FAST, REPO, compose_train, train_from
from tests.test_reliability import stop_mid_run
from xsa_lm.config.spec import VALUES_ONLY, TrainSpec, parse
from xsa_lm.data.datamodule import padded_for_ranks
from xsa_lm.errors import UserError
from xsa_lm.train import devices
from xsa_lm.train.run import make_module, make_trainer, set_up_process

N_LAYER = 2
STEPS = 3
VAL_WINDOWS = 5
ACCUMULATE = 4  # global_batch_tokens 1024 = 4 x (micro-batch 2 x 2 ranks x 64 tokens)


# --- each rank's device, before any CUDA call -------------------------------------------------------------------

CUDA_CALLS = ("set_device", "mem_get_info", "get_device_name", "is_bf16_supported", "get_device_properties", "init")


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Four CUDA devices that record every call which would open a CUDA context, in order; 1 byte free, so the run
    stops at its memory check."""
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    results = {"mem_get_info": (1, 2), "get_device_name": "Fake GPU", "is_bf16_supported": True}
    for name in CUDA_CALLS:
        monkeypatch.setattr(
            torch.cuda, name, lambda *args, _name=name, **kwargs: calls.append((_name, *args)) or results.get(_name)
        )
    for variable in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(variable, raising=False)
    return calls


@pytest.mark.parametrize(
    "env, trainer, expected",
    [
        ({"LOCAL_RANK": "1"}, ["trainer=ddp"], 1),
        ({"SLURM_LOCALID": "1"}, ["trainer=ddp"], 1),
        ({"LOCAL_RANK": "1"}, ["trainer=ddp", "trainer.devices=[2,3]"], 3),
        ({}, ["trainer=gpu"], 0),
    ],
    ids=["torchrun", "srun", "device-list", "one-gpu"],
)
def test_each_rank_sets_its_device_before_any_cuda_call(
    fake_gpus: list[tuple], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict, trainer: list[str], expected
):
    """The memory check, bf16 support and the device's name all come after set_device(this rank's GPU)."""
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    cfg = compose_train([*FAST, *trainer, "trainer.precision=auto", "micro_batch_size=4"])
    with pytest.raises(UserError, match="this run needs about"):
        train_from(cfg, tmp_path / "run")
    names = [call[0] for call in fake_gpus]
    assert fake_gpus[0] == ("set_device", expected), fake_gpus
    assert {"mem_get_info", "is_bf16_supported"} <= set(names[1:])  # the calls that used to come first


def test_a_cpu_run_or_a_rank_beyond_the_visible_gpus_sets_no_device(
    fake_gpus: list[tuple], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("LOCAL_RANK", "1")
    devices.set_device(accelerator="cpu", devices=2)
    monkeypatch.setenv("LOCAL_RANK", "4")  # 4 GPUs visible: Lightning's own check names the mismatch
    devices.set_device(accelerator="gpu", devices="auto")
    assert fake_gpus == []


def test_the_host_heap_tweak_is_for_cpu_runs_only(fake_gpus: list[tuple], monkeypatch: pytest.MonkeyPatch):
    """glibc keeping freed memory helps a CPU run, whose tensors live on the host; a GPU run leaves malloc alone."""
    tweaked = []
    monkeypatch.setattr("xsa_lm.train.run.reuse_freed_host_memory", lambda: tweaked.append(True) or True)
    set_up_process(parse(TrainSpec, compose_train([*FAST, "trainer=gpu"])))
    assert tweaked == []
    set_up_process(parse(TrainSpec, compose_train([*FAST, "trainer=cpu"])))
    assert tweaked == [True]


# --- data-loader workers and compile: auto --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "accelerator", "ranks_per_node", "expected"),
    [("auto", "cpu", 1, 0), (3, "cpu", 1, 3), ("auto", "gpu", 8, 4), ("auto", "auto", 16, 2), ("auto", "gpu", 64, 1)]
    + [(0, "gpu", 8, 0)],
)
def test_num_workers_auto_is_none_on_cpu_and_the_nodes_cpus_shared_on_gpu(
    workers, accelerator: str, ranks_per_node: int, expected: int, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: accelerator != "cpu")  # 32 CPUs on the node
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert devices.loader_workers(workers, accelerator=accelerator, ranks_per_node=ranks_per_node) == expected


@pytest.mark.parametrize("cuda", [False, True])
def test_compile_auto_is_on_for_cuda_runs_only(cuda: bool, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert devices.compile_enabled("auto", accelerator="auto") is devices.compile_enabled("auto", accelerator="gpu")
    assert devices.compile_enabled("auto", accelerator="gpu") is cuda
    assert devices.compile_enabled("auto", accelerator="cpu") is False
    assert devices.compile_enabled(True, accelerator="cpu") and not devices.compile_enabled(False, accelerator="gpu")


def test_the_defaults_are_auto_and_ddp_keeps_gradients_in_its_buckets():
    import hydra
    from lightning.pytorch.strategies import DDPStrategy

    cfg = compose_train(["trainer=ddp"])
    assert cfg.compile == "auto" and cfg.data.num_workers == "auto"
    parse(TrainSpec, cfg, VALUES_ONLY)  # the refusals: test_schema.py
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_kwargs["gradient_as_bucket_view"] is True


# --- 2 gloo processes ------------------------------------------------------------------------------------------

WORKER_ARGS = [a for a in FAST if a != "trainer=cpu" and not a.startswith("micro_batch_size")]
WORKER_ARGS += (
    "trainer=fsdp trainer.accelerator=cpu trainer.devices=2 trainer.precision=32-true micro_batch_size=2".split()
)
WORKER_ARGS += f"model.n_layer={N_LAYER} model.vocab_size=512 attention=xsa val_every_steps=1000".split()
WORKER_ARGS += f"trainer.max_steps={STEPS} scheduler.total_steps={STEPS} faults.spike_factor=null".split()
# The same training in one process: both ranks' sequences side by side, in micro-batches of 4.
PER_RANK = ("trainer=", "trainer.accelerator", "trainer.devices", "micro_batch")
ONE_PROCESS_ARGS = [a for a in WORKER_ARGS if not a.startswith(PER_RANK)] + ["trainer=cpu", "micro_batch_size=4"]
# What a block computes with under bf16-mixed, whatever the strategy (recording_blocks).
BF16_MIXED_BLOCK = dict.fromkeys(("x", "cos", "sin", "out"), "torch.float32")
BF16_MIXED_BLOCK |= {"params": ["torch.float32"], "autocast": "torch.bfloat16"}


class RandomTokens(torch.utils.data.IterableDataset):
    """Micro-batches of random tokens, another stream of 2 sequences per rank; one process given several ranks'
    streams gets their sequences side by side: the global batch the ranks see together."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks

    def __iter__(self):
        generators = [torch.Generator().manual_seed(rank) for rank in self.ranks]
        while True:
            tokens = torch.cat([torch.randint(0, 512, (2, 65), generator=g) for g in generators])
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def fit_once(
    overrides: list[str], rank: int, run_dir: Path, *, args: list[str] = WORKER_ARGS, blocks: dict | None = None
) -> dict:
    """Train STEPS optimizer steps through the run's own make_module and make_trainer; what this rank saw. One
    process (args=ONE_PROCESS_ARGS) trains on both ranks' streams. `blocks`: filled by recording_blocks."""
    from xsa_lm.model import gpt

    spec = parse(TrainSpec, compose_train([*args, *overrides]))
    assert spec.accumulate == ACCUMULATE
    # FSDP2 reduce-scatters through dist.reduce_scatter_single (dist.reduce_scatter_tensor before torch 2.13).
    scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    forward = gpt.Block._forward if blocks is None else recording_blocks(blocks)
    seen: dict = {"losses": []}
    with (
        mock.patch.object(dist, "broadcast", wraps=dist.broadcast) as broadcasts,
        mock.patch.object(dist, scatter, wraps=getattr(dist, scatter)) as reduce_scatters,
        mock.patch.object(gpt.Block, "_forward", forward),
    ):

        class Record(L.Callback):
            def on_train_start(self, trainer, pl_module) -> None:
                broadcasts.reset_mock()  # the training loop's calls only
                reduce_scatters.reset_mock()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                seen["losses"].append(float(outputs["loss"]))

            def on_train_end(self, trainer, pl_module) -> None:
                seen.update(broadcasts=broadcasts.call_count, reduce_scatters=reduce_scatters.call_count)

        set_up_process(spec)  # the seed: every fit starts from the same weights
        module = make_module(spec, spec.gpt_config(512))
        trainer = make_trainer(spec, run_dir, callbacks=[Record()], loggers=[])
        streams = (rank,) if spec.trainer.world_size > 1 else (0, 1)  # one device: the global batch of both ranks
        loader = torch.utils.data.DataLoader(RandomTokens(streams), batch_size=None)
        trainer.fit(module, train_dataloaders=loader)
    return seen


def validate_once(run_dir: Path) -> dict:
    """An odd number of validation windows over 2 ranks under FSDP2, and the mean over all of them in one process."""
    spec = parse(TrainSpec, compose_train(WORKER_ARGS))
    set_up_process(spec)
    module = make_module(spec, spec.gpt_config(512))
    tokens = torch.randint(0, 512, (VAL_WINDOWS, 65), generator=torch.Generator().manual_seed(0))
    windows = [(t[:-1], t[1:]) for t in tokens]
    with torch.no_grad():
        reference = sum(float(module.model(x[None], y[None])[1]) for x, y in windows) / VAL_WINDOWS
    trainer = make_trainer(spec, run_dir, callbacks=[], loggers=[])
    loader = torch.utils.data.DataLoader(padded_for_ranks(windows, 2), batch_size=2)
    validated = trainer.validate(module, dataloaders=loader, verbose=False)[0]["val/loss"]
    return {"validated": validated, "reference": reference}


def recording_blocks(seen: dict) -> object:
    """Block._forward recording the dtypes of a block's inputs (x, the RoPE tables), output, parameters as its forward
    sees them (under FSDP2 the gathered ones) and autocast's (None: off)."""
    from xsa_lm.model import gpt

    original = gpt.Block._forward

    def recording(self, x, cos, sin, cache):
        out = original(self, x, cos, sin, cache)
        device = x.device.type
        seen.update({name: str(t.dtype) for name, t in dict(x=x, cos=cos, sin=sin, out=out).items()})
        seen["params"] = sorted({str(p.dtype) for p in self.parameters()})
        seen["autocast"] = str(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
        return out

    return recording


def worker(out: Path) -> None:
    """Four fits in each of the 2 processes: FSDP2 as the run trains in fp32 and in bf16-mixed, with a gradient
    reduction on every micro-batch, and compiled through a backend that records each graph."""
    import torch.distributed.fsdp as fsdp

    from xsa_lm.train import module

    rank = int(os.environ["RANK"])
    run_dir = out / f"rank{rank}"
    result = {"deferred": fit_once([], rank, run_dir), "validation": validate_once(run_dir)}
    blocks: dict = {}
    result["bf16"] = {**fit_once(["trainer.precision=bf16-mixed"], rank, run_dir, blocks=blocks), "blocks": blocks}
    with mock.patch.object(fsdp.FSDPModule, "set_requires_gradient_sync"):  # always on: every micro-batch
        result["every_micro_batch"] = fit_once([], rank, run_dir)
    graphs: list[list[str]] = []

    def recording_backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(sorted({getattr(n.target, "__name__", str(n.target)) for n in graph.graph.nodes}))
        return graph.forward  # runs as traced: the same numbers as eager

    with mock.patch.object(module, "compile_model", partial(module.compile_model, backend=recording_backend)):
        result["compiled"] = {**fit_once(["compile=true"], rank, run_dir), "graphs": graphs}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("multi_device")
    port = str(free_port())
    procs, logs = [], [out / f"rank{rank}.log" for rank in range(2)]
    for rank, log in enumerate(logs):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "SLURM_"))}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        with open(log, "w") as f:
            command = [sys.executable, "-m", "tests.test_multi_device", str(out)]
            procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT))
    try:
        for proc in procs:
            proc.wait(timeout=240)
    finally:
        for proc in procs:
            proc.kill()  # a rank left waiting for the other, if one failed
    tails = "".join(log.read_text()[-3000:] for log in logs)
    assert all(proc.returncode == 0 for proc in procs), tails
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_the_validation_loss_is_that_of_one_process_on_any_rank_count(two_ranks: list[dict]):
    """5 windows on 2 ranks: 3 on one, 2 and a padding window on the other; each window counts once."""
    for rank in two_ranks:
        assert rank["validation"]["validated"] == pytest.approx(rank["validation"]["reference"], rel=1e-6)


@pytest.fixture(scope="module")
def one_process_bf16(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The workers' bf16-mixed fit in this one process, on both ranks' sequences."""
    blocks: dict = {}
    run_dir = tmp_path_factory.mktemp("one_process")
    run = fit_once(["trainer.precision=bf16-mixed"], 0, run_dir, args=ONE_PROCESS_ARGS, blocks=blocks)
    return {**run, "blocks": blocks}


@pytest.mark.slow
def test_fsdp2_in_bf16_trains_as_one_process_in_bf16(two_ranks: list[dict], one_process_bf16: dict):
    """Each micro-batch's loss under FSDP2 (the 2 ranks' mean) against one process's: the first step within 1e-6
    (measured 1.5e-7; FSDP2's param_dtype=bf16 gave 7.4e-6), later ones within 3e-5 (measured 7.2e-6: each rank
    rounds its own gradients to bf16 before the fp32 reduction, as DDP does)."""
    sharded = [(a + b) / 2 for a, b in zip(*(rank["bf16"]["losses"] for rank in two_ranks), strict=True)]
    single = one_process_bf16["losses"]
    assert len(single) == STEPS * ACCUMULATE
    assert sharded[:ACCUMULATE] == pytest.approx(single[:ACCUMULATE], rel=1e-6, abs=0)
    assert sharded == pytest.approx(single, rel=3e-5, abs=0)


@pytest.mark.slow
def test_a_block_computes_in_the_same_dtypes_under_every_strategy(
    two_ranks: list[dict], one_process_bf16: dict, tmp_path: Path
):
    """bf16-mixed: a block's residual stream, RoPE tables and parameters fp32, its matmuls bf16 under autocast, in one
    process and under FSDP2; DDP gets one process's autocast from Lightning (checked here) and keeps fp32 weights."""
    assert one_process_bf16["blocks"] == BF16_MIXED_BLOCK
    for rank in two_ranks:
        assert rank["bf16"]["blocks"] == BF16_MIXED_BLOCK
    autocasts = []
    for strategy in (["trainer=cpu"], ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]):
        cfg = compose_train([*FAST, *strategy, "trainer.precision=bf16-mixed", "micro_batch_size=4"])
        plugin = make_trainer(parse(TrainSpec, cfg), tmp_path, callbacks=[], loggers=[]).precision_plugin
        autocasts.append((type(plugin).__name__, plugin.precision, getattr(plugin, "device", None)))
    assert autocasts == [("MixedPrecision", "bf16-mixed", "cpu")] * 2


def test_one_process_in_bf16_keeps_the_residual_stream_and_rope_tables_in_fp32(monkeypatch: pytest.MonkeyPatch):
    from xsa_lm.model import GPT, GPTConfig, gpt

    seen: dict = {}
    monkeypatch.setattr(gpt.Block, "_forward", recording_blocks(seen))
    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, head_dim=16, block_size=16, vocab_size=64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.zeros(1, 8, dtype=torch.long))
    assert seen == BF16_MIXED_BLOCK


@pytest.mark.slow
def test_fsdp2_reduces_gradients_once_per_optimizer_step_and_broadcasts_nothing(two_ranks: list[dict]):
    """One reduce-scatter per FSDP unit (each block and the root) per step, not per micro-batch, with the losses of
    reducing after every micro-batch; no broadcast (Lightning's loop sends its SIGTERM flag before each)."""
    units = N_LAYER + 1
    for rank in two_ranks:
        assert len(rank["deferred"]["losses"]) == STEPS * ACCUMULATE and rank["deferred"]["broadcasts"] == 0
        assert rank["deferred"]["reduce_scatters"] == STEPS * units
        assert rank["every_micro_batch"]["reduce_scatters"] == STEPS * ACCUMULATE * units  # the counter counts
        assert rank["deferred"]["losses"] == pytest.approx(rank["every_micro_batch"]["losses"], rel=1e-5)


@pytest.mark.slow
def test_compile_under_fsdp2_covers_the_blocks_the_head_and_the_loss(two_ranks: list[dict]):
    for rank in two_ranks:
        graphs = rank["compiled"]["graphs"]
        assert any("cross_entropy" in ops and "linear" in ops for ops in graphs), graphs  # the head and the loss
        assert any("scaled_dot_product_attention" in ops for ops in graphs), graphs  # the blocks
        assert rank["compiled"]["losses"] == pytest.approx(rank["deferred"]["losses"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.long
def test_sigterm_to_rank_0_alone_stops_both_ranks_at_one_step(data_cache: Path, tmp_path: Path):
    """Without Lightning's per-batch broadcast, the run's Preemption callback agrees on the stop (at logging steps):
    both ranks stop after the same step, and last.ckpt holds it."""
    run_dir = tmp_path / "run"
    args = ["train", *FAST, "trainer.devices=2", "trainer.strategy=ddp", "micro_batch_size=4", "val_every_steps=10"]
    stopped = stop_mid_run([*args, f"hydra.run.dir={run_dir}"], signal.SIGTERM, data_cache=data_cache, cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "preempted"


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
