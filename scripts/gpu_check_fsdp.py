"""FSDP2 at the paper's sizes rehearsed on one device (scripts/gpu_check.sh's fsdp_fake step): rank 0 of a world of
8 or 64 under torch's fake process group, whose collectives move no data, so one device holds exactly one rank's
shards and buffers.

    python scripts/gpu_check_fsdp.py DIR --device cuda --models paper_0.7b,paper_1.4b,paper_2.7b --world-sizes 8,64
        --real paper_0.7b:8

Per model and world size, one rank's peak memory by kind (sharded and gathered parameters, gradients, AdamW state,
activations, temporaries) from torch's FSDPMemTracker over two training steps under FakeTensorMode (the tensors have
shapes and devices but no storage: a 2.7B model at world size 8 costs no memory and little time), against the plan
(xsa_lm.train.memory.estimate, strategy fsdp), at the paper runs' shape (bf16-mixed, 2048 x micro-batch, GPT-2's
vocabulary). Before them, `--real MODEL:WORLD` (what only a real device measures): the same rank with real tensors,
compiled as training compiles, a few steps: its allocator's peak against the compiled plan, and the graphs Dynamo
compiled after the first step and after the last (a steady state compiles nothing). Under a fake group the gathered
weights are uninitialised memory, so losses are meaningless: only memory and compiling are measured.
"""

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_check_measure import Deadline, bench_spec, compile_seconds
from gpu_check_summary import record
from gpu_xsa_lm import use_working_tree

# The fake rows' shape, whatever --real's: the paper runs' (fake tensors cost the same time at any size)
PAPER = {"precision": "bf16-mixed", "context": 2048, "vocab_size": 50304}


def fake_world(world_size: int, device: torch.device):
    """Rank 0 of `world_size` under the fake process group, and its one-dimensional data-parallel mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return init_device_mesh(device.type, (world_size,))


def sharded_model(config, mesh, device: torch.device, setup, *, compiled: bool = False, fused: bool = True):
    """The model as trainer=fsdp builds it (compiled, then sharded), and its optimizer as the run builds it (fused
    AdamW, as LMModule.configure_optimizers; unfused for fake tensors, where torch 2.13's fused op counted 17 times
    the state of the shard on CPU: the state is the same two moments either way)."""
    from xsa_lm.model import GPT
    from xsa_lm.train.module import compile_model, param_groups, shard_model

    with torch.device(device):
        model = GPT(config)
    if compiled:
        compile_model(model)
    shard_model(model, mesh)
    keywords = setup.optimizer.keywords
    kwargs = {} if "fused" in keywords else {"fused": fused}
    return model, setup.optimizer(param_groups(model, keywords.get("weight_decay", 0.0)), **kwargs)


def train_step(model, opt, batch, setup) -> None:
    x, y = batch
    with setup.autocast():
        loss = model(x, y)[1]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def tokens(config, micro_batch: int, device: torch.device):
    x = torch.randint(0, config.vocab_size, (micro_batch, config.block_size + 1), device=device)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def plan(config, setup, micro_batch: int, world_size: int, *, compiled: bool) -> dict[str, int]:
    from xsa_lm.train.memory import estimate

    exclusive = config.attention_class.exclusive_memory
    shape = (config.vocab_size, micro_batch, config.block_size, setup.precision, "fsdp", world_size)
    return estimate(asdict(config), *shape, compiled=compiled, exclusive=exclusive).as_dict()


def fake_memory(config, setup, *, world_size: int, micro_batch: int) -> dict:
    """One rank's peak by FSDPMemTracker's kinds over two steps (the second has AdamW's state) in FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    t0, mesh = time.perf_counter(), fake_world(world_size, setup.device)
    with FakeTensorMode():
        model, opt = sharded_model(config, mesh, setup.device, setup, fused=False)
        batch = tokens(config, micro_batch, setup.device)
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs(batch)
        with tracker:
            train_step(model, opt, batch, setup)
            tracker.reset_mod_stats()  # the per-module records (it refuses a second iteration); not the peak
            train_step(model, opt, batch, setup)
        # the device's (an unfused AdamW keeps its step counts on the host)
        peak = next(v for d, v in tracker.get_tracker_snapshot("peak").items() if d.type == setup.device.type)
    by_kind = {str(getattr(kind, "value", kind)): int(n) for kind, n in peak.items() if n}
    planned = plan(config, setup, micro_batch, world_size, compiled=False)
    return {
        "world_size": world_size,
        "measured": by_kind,
        "planned": planned,
        "measured_over_planned": by_kind["Total"] / planned["total"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def local_bytes(model, opt) -> int:
    """This rank's shards of the weights and of AdamW's state: what stays allocated between steps."""
    from torch.distributed.tensor import DTensor

    def size(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    return sum(size(t) for t in [*model.parameters(), *state])


def step_peak(step, device: torch.device) -> int:
    """The most bytes allocated during step() beyond what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return torch.cuda.max_memory_allocated(device) - before
    from calibrate_memory import allocator_peak

    return allocator_peak(step)


def real_run(config, setup, *, world_size: int, micro_batch: int, steps: int) -> dict:
    """One rank with real tensors, each block and the head compiled as training compiles them: the peak of a step
    against the compiled plan, and Dynamo's graphs after the first step and after the last."""
    from torch._dynamo.utils import counters

    t0, mesh = time.perf_counter(), fake_world(world_size, setup.device)
    torch._dynamo.reset()
    model, opt = sharded_model(config, mesh, setup.device, setup, compiled=True)
    batch = tokens(config, micro_batch, setup.device)
    train_step(model, opt, batch, setup)
    graphs_first = counters["stats"]["unique_graphs"]
    for _ in range(steps - 2):
        train_step(model, opt, batch, setup)
    peak = step_peak(lambda: train_step(model, opt, batch, setup), setup.device)
    graphs_last = counters["stats"]["unique_graphs"]
    measured = peak + local_bytes(model, opt)
    planned = plan(config, setup, micro_batch, world_size, compiled=True)
    return {
        "world_size": world_size,
        "steps": steps,
        "measured": {"Total": measured, "step_peak": peak},
        "planned": planned,
        "measured_over_planned": measured / planned["total"],
        "graphs_after_first_step": graphs_first,
        "recompiles_after_first_step": graphs_last - graphs_first,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def configs(args: argparse.Namespace, name: str, *, context: int, vocab_size: int, overrides=(), precision=None):
    """XSA's model config and the plain loop's setup (bf16-mixed on a GPU, else fp32, unless `precision`)."""
    from dataclasses import replace

    spec_args = argparse.Namespace(
        model=name, context=context, micro_batch=args.micro_batch, vocab_size=vocab_size, override=list(overrides)
    )
    spec = bench_spec(spec_args)
    setup = replace(spec.setup_on(torch.device(args.device)), compile=False)
    return spec.models[1], setup if precision is None else replace(setup, precision=precision)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="the check's directory (measurements.json)")
    parser.add_argument("--key", default="fsdp_fake")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--models", type=lambda s: s.split(","), default=["paper_0.7b", "paper_1.4b", "paper_2.7b"])
    parser.add_argument("--world-sizes", type=lambda s: [int(n) for n in s.split(",")], default=[8, 64])
    parser.add_argument("--context", type=int, default=2048, help="--real's (the fake rows': 2048)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=50304, help="--real's (the fake rows': GPT-2's, padded)")
    parser.add_argument("--real", default=None, help="MODEL:WORLD_SIZE run with real tensors, compiled")
    parser.add_argument("--real-override", action="append", default=[], help="a Hydra override for --real's model")
    parser.add_argument("--steps", type=int, default=3, help="--real's steps (at least 2)")
    args = parser.parse_args()
    use_working_tree()
    from xsa_lm.train.hardware import device_name

    deadline = Deadline()
    result: dict = {"device": device_name(torch.device(args.device)), "fake": {}, "skipped": []}
    if args.real:  # first: what only a real device measures
        name, world_size = args.real.split(":")
        config, setup = configs(
            args, name, context=args.context, vocab_size=args.vocab_size, overrides=args.real_override
        )
        real = real_run(config, setup, world_size=int(world_size), micro_batch=args.micro_batch, steps=args.steps)
        result["real"] = {"model": name, "precision": setup.precision} | real
        result["compile_seconds"] = compile_seconds()
        record(args.directory, args.key, result)
        print(f"{args.key}: real {name} at world size {world_size}: {real}", flush=True)
    for name in args.models:
        config, setup = configs(args, name, **PAPER)
        rows = result["fake"].setdefault(name, {"precision": setup.precision, "world_sizes": []})
        for world_size in args.world_sizes:
            last = rows["world_sizes"][-1]["seconds"] if rows["world_sizes"] else 0
            if deadline.left() < 1.5 * last:
                result["skipped"].append(f"{name} at {world_size}: {deadline.left():.0f} s left")
                continue
            measured = fake_memory(config, setup, world_size=world_size, micro_batch=args.micro_batch)
            rows["world_sizes"].append(measured)
            record(args.directory, args.key, result)
            print(
                f"{args.key}: {name} at world size {world_size}: {measured['measured_over_planned']:.2f}x plan "
                f"in {measured['seconds']} s",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
