"""`xsa-lm consolidate ckpt=DIR out=FILE`: a sharded checkpoint of trainer=fsdp as one file, to copy or share."""

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from xsa_lm.checkpoints.load import check_checkpoint_file
from xsa_lm.checkpoints.sharded import is_sharded, load_sharded
from xsa_lm.config.spec import Spec, parse
from xsa_lm.errors import UserError, one_line_errors
from xsa_lm.files import atomic_file


class ConsolidateOptions(Spec):
    ckpt: str
    out: str
    weights_only: bool


def consolidate(source: Path, out: Path, weights_only: bool = False) -> int:
    if source.is_file():
        raise UserError(f"ckpt: {source} is a file, one checkpoint already: every command reads it as it is")
    if not is_sharded(source):
        what = "not found" if not source.exists() else "no sharded checkpoint"
        raise UserError(
            f"ckpt: {source} is {what}: give the directory of a sharded checkpoint (trainer=fsdp), e.g. "
            "runs/x/checkpoints/last.ckpt"
        )
    check_checkpoint_file(source, key="ckpt")  # every shard there, whole
    if out.exists():
        raise UserError(f"out: {out} exists; choose another path (nothing is overwritten)")
    checkpoint = load_sharded(source, optimizer=not weights_only)
    if weights_only:
        checkpoint = {key: checkpoint[key] for key in ("state_dict", "model_config", "global_step")}
    with atomic_file(out, "wb", replace=False) as f:  # whole or not at all; a file made meanwhile is kept too
        torch.save(checkpoint, f)
    return checkpoint["global_step"]


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="consolidate")
@one_line_errors
def main(cfg: DictConfig) -> None:
    options = parse(ConsolidateOptions, cfg)
    out = Path(options.out).expanduser()
    step = consolidate(Path(options.ckpt).expanduser(), out, weights_only=options.weights_only)
    kept = "weights only" if options.weights_only else "weights, optimizer state and training position"
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): step {step}, {kept}")
