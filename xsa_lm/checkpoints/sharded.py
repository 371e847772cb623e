"""Sharded checkpoints of FSDP2 runs (a directory of torch.distributed.checkpoint shards, `.metadata` and `meta.pt`),
read in one process, without a process group, as the ordinary checkpoint a single process writes."""

from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from xsa_lm.compat import read_distributed_checkpoint

META = "meta.pt"  # what ModelParallelStrategy writes beside the tensor shards: the rest of the checkpoint


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def shards_complete(path: Path) -> bool:
    """Whether every file the metadata names is there and long enough: a copy or write cut short is refused."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception:  # noqa: BLE001 - a truncated .metadata fails in pickle with any error
        return False
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    files = {name: path / name for name in ends}
    return (path / META).is_file() and all(f.is_file() and f.stat().st_size >= ends[n] for n, f in files.items())


def load_sharded(path: Path, optimizer: bool = True) -> dict:
    """The checkpoint as one process would have saved it; optimizer=False reads the weights only (a third)."""
    tensors = read_distributed_checkpoint(path, keys=None if optimizer else {"state_dict"})
    checkpoint = torch.load(path / META, map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = tensors.pop("state_dict")
    optimizers = sorted((k for k in tensors if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    if optimizer:
        checkpoint["optimizer_states"] = [by_position(tensors[k]) for k in optimizers]
    return checkpoint


def by_position(state: dict) -> dict:
    """A sharded optimizer state keyed by parameter position, as torch.optim wants, not by name."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    position = {name: i for i, name in enumerate(names)}
    groups = [{**group, "params": [position[name] for name in group["params"]]} for group in state["param_groups"]]
    return {"state": {position[name]: value for name, value in state["state"].items()}, "param_groups": groups}
