"""Checkpoint write time: Lightning's TorchCheckpointIO (serialise into memory, then a temporary file, then the
target) against AtomicCheckpointIO (torch.save into <target>.tmp beside it, fsync, rename) -> a table and JSON.

    python scripts/bench_checkpoint_write.py --mib 400 --repeats 3 --out bench_checkpoint.json
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from xsa_lm.checkpoints.atomic import AtomicCheckpointIO
from xsa_lm.train.runinfo import run_info


def checkpoint_of(mib: int) -> dict:
    """Tensors like a model's and its AdamW state (1/4 weights, 1/4 gradients-free moments x 2, in 64 MiB pieces)."""
    pieces = max(1, mib // 64)
    numel = mib * 2**20 // 4 // pieces
    return {"global_step": 1, "state_dict": {f"w{i}": torch.randn(numel) for i in range(pieces)}}


def time_write(io, checkpoint: dict, path: Path) -> float:
    t0 = time.perf_counter()
    io.save_checkpoint(checkpoint, path)
    if isinstance(io, TorchCheckpointIO) and not isinstance(io, AtomicCheckpointIO):
        with open(path, "rb+") as f:  # the same durability as the atomic writer, for a fair comparison
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder under the cwd)")
    parser.add_argument("--out", default="bench_checkpoint.json")
    args = parser.parse_args()
    checkpoint = checkpoint_of(args.mib)
    writers = {"lightning": TorchCheckpointIO(), "atomic": AtomicCheckpointIO()}
    times: dict[str, list[float]] = {name: [] for name in writers}
    with tempfile.TemporaryDirectory(dir=args.dir or ".") as folder:
        for _ in range(args.repeats):  # interleaved: the page cache and the disk's state hit both alike
            for name, io in writers.items():
                path = Path(folder) / f"{name}.ckpt"
                times[name].append(time_write(io, checkpoint, path))
                path.unlink()
    size = sum(t.numel() * 4 for t in checkpoint["state_dict"].values())
    result = {
        "checkpoint_mib": size / 2**20,
        "seconds": times,
        "best_s": {name: min(ts) for name, ts in times.items()},
        "atomic_over_lightning": min(times["atomic"]) / min(times["lightning"]),
        "tmpdir": tempfile.gettempdir(),
        "run_info": run_info(),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"| writer | best of {args.repeats} (s) | all (s) |\n|---|---:|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.2f} | {', '.join(f'{t:.2f}' for t in ts)} |")
    print(f"checkpoint {result['checkpoint_mib']:.0f} MiB; atomic / lightning = {result['atomic_over_lightning']:.2f}")


if __name__ == "__main__":
    main()
