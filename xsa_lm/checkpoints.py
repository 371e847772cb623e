"""Checkpoints of `xsa-lm train` runs as plain models: the GPT (from the file alone) and the run's tokenizer.

Used by `xsa-lm analyze`, `xsa-lm eval` and `xsa-lm generate`. A checkpoint lives in <run dir>/checkpoints/, next to
the run's config.yaml, run_info.json and summary.json.
"""

import json
import pickle
from pathlib import Path

import torch
from tokenizers import Tokenizer

from xsa_lm.errors import UserError
from xsa_lm.model import GPT, GPTConfig


def checkpoint_list(ckpts) -> list[str]:
    """The `ckpts=[...]` of analyze and eval, refused in one line when empty."""
    if not ckpts:
        raise UserError("ckpts: give at least one checkpoint, e.g. ckpts=[runs/sa/checkpoints/last.ckpt]")
    return list(ckpts)


def run_dir_of(path: Path) -> Path:
    return path.parent.parent


def load_model(path: Path) -> GPT:
    """A GPT from a Lightning checkpoint of `xsa-lm train` (weights only: no code is unpickled)."""
    if not path.is_file():
        raise UserError(f"ckpts: checkpoint not found: {path}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:  # truncated or foreign
        raise UserError(f"ckpts: {path} is not a readable checkpoint ({type(e).__name__}: {str(e)[:120]})") from None
    fields = checkpoint.get("model_config")
    summary = run_dir_of(path) / "summary.json"
    if fields is None and summary.exists():  # checkpoints written before the config was stored in them
        fields = json.loads(summary.read_text())["model_config"]
    if fields is None or "state_dict" not in checkpoint:
        raise UserError(f"ckpts: {path} has no model config or weights: is it a checkpoint of `xsa-lm train`?")
    model = GPT(GPTConfig(**fields))  # GPTConfig turns a stored xsa_layers list back into a tuple
    state = {k.removeprefix("model.").replace("_orig_mod.", ""): v for k, v in checkpoint["state_dict"].items()}
    model.load_state_dict(state)  # compiled runs store _orig_mod.<name>: the eager model takes them back
    return model


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer the checkpoint's run trained with: saved with its prepared data (run_info.json names it)."""
    run_dir = run_dir_of(path)
    info = run_dir / "run_info.json"
    if info.exists():
        tokenizer_file = Path(json.loads(info.read_text()).get("data_dir", "")) / "tokenizer.json"
        if tokenizer_file.is_file():
            return Tokenizer.from_file(str(tokenizer_file))
    from omegaconf import OmegaConf

    from xsa_lm.data.run import prepare_data

    if not (run_dir / "config.yaml").exists():
        raise UserError(f"{path}: no run_info.json or config.yaml in {run_dir}: cannot tell which tokenizer it used")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    return prepare_data(cfg.data, cfg.tokenizer).tokenizer
