"""Checkpoints of `xsa-lm train` runs as plain models: the GPT (from the file alone) and the run's tokenizer.

Used by `xsa-lm analyze`, `xsa-lm eval` and `xsa-lm generate`. A checkpoint lives in <run dir>/checkpoints/, next to
the run's config.yaml, run_info.json and summary.json: a file, or a directory of shards (trainer=fsdp: sharded.py).
"""

import json
import pickle
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

import torch
from tokenizers import Tokenizer

from xsa_lm.checkpoints.sharded import is_sharded, load_sharded, shards_complete
from xsa_lm.errors import UserError
from xsa_lm.model import GPT, GPTConfig


def check_checkpoint_file(path: Path, key: str = "ckpts") -> None:
    """Refuse, in one line naming the path, anything that cannot be a checkpoint: a missing path, a directory that
    is no sharded checkpoint (or one with a shard missing), an empty file, or a file that is no torch.save archive
    (a config.yaml, a text file, a truncated download)."""
    if is_sharded(path):
        if not shards_complete(path):
            raise UserError(f"{key}: {path} is an incomplete sharded checkpoint (a shard is missing or truncated)")
        return
    if path.is_dir():
        inside = [p for p in (path / "checkpoints" / "last.ckpt", path / "last.ckpt") if p.exists()]
        example = inside[0] if inside else "runs/sa/checkpoints/last.ckpt"
        raise UserError(f"{key}: {path} is a directory, not a checkpoint: give a .ckpt file, e.g. {example}")
    if not path.is_file():
        raise UserError(f"{key}: checkpoint not found: {path}")
    if path.stat().st_size == 0:
        raise UserError(f"{key}: {path} is empty, not a checkpoint")
    # torch.save writes zip archives; torch.load on anything else falls back to the legacy pickle reader, which
    # fails with arbitrary errors (IndexError on a YAML file, KeyError on text).
    if not zipfile.is_zipfile(path):
        raise UserError(
            f"{key}: {path} is not a checkpoint of `xsa-lm train` (not a torch.save file, or truncated): "
            "give a .ckpt file from <run dir>/checkpoints/"
        )


def checkpoint_list(ckpts: Sequence[object] | None) -> list[str]:
    """The `ckpts=[...]` of analyze and eval, refused in one line when empty or when one of them cannot be a
    checkpoint (checked up front, before any slow work)."""
    if not ckpts:
        raise UserError("ckpts: give at least one checkpoint, e.g. ckpts=[runs/sa/checkpoints/last.ckpt]")
    for ckpt in ckpts:
        check_checkpoint_file(Path(str(ckpt)).expanduser())
    return [str(ckpt) for ckpt in ckpts]


def run_dir_of(path: Path) -> Path:
    return path.parent.parent


def _comparable(config: dict) -> dict:
    """Defaults filled in and values normalised the way GPTConfig does (n_kv_head None -> n_head, xsa_layers as a
    sorted tuple, a JSON list included), so that equal models compare equal. Keys GPTConfig does not know (a config
    of another version) are kept as they are."""
    known = {f.name: f.default for f in fields(GPTConfig)}
    ours = {k: v for k, v in config.items() if k in known}
    try:
        normalised = asdict(GPTConfig(**ours))
    except (TypeError, ValueError):  # invalid values: compare them as stored
        normalised = known | ours
    return normalised | {k: v for k, v in config.items() if k not in known}


_ABSENT = object()  # a key only one side has (a config from another version)


def _shown(value: object) -> str:
    if value is _ABSENT:
        return "(absent)"
    return str(list(value)) if isinstance(value, tuple) else str(value)


def model_config_mismatch(saved: dict, expected: dict) -> list[str]:
    """The GPTConfig fields in which a checkpoint's stored `model_config` differs from the expected model, each as
    `key: saved -> expected` (e.g. ["d_model: 128 -> 64", "attention: sa -> xsa"]); empty when they describe the
    same model. Every field counts, not only those that change weight shapes: a resumed run must stay the model it
    started as."""
    saved, expected = _comparable(saved), _comparable(expected)
    keys = list(dict.fromkeys([*expected, *saved]))
    return [
        f"{key}: {_shown(saved.get(key, _ABSENT))} -> {_shown(expected.get(key, _ABSENT))}"
        for key in keys
        if saved.get(key, _ABSENT) != expected.get(key, _ABSENT)
    ]


def load_weights(model: GPT, checkpoint: dict, source: str) -> None:
    """checkpoint["state_dict"] (a Lightning checkpoint of `xsa-lm train`) into `model`. Weights of another
    architecture are refused in one line that names the differing GPTConfig fields, e.g. "resume: checkpoint
    runs/x/checkpoints/last.ckpt is of another model: d_model: 128 -> 64" (`source` starts the message)."""
    # Lightning prefixes the module's attribute (`model.`); a torch.compile(model) wrapper added `_orig_mod.`.
    state = {k.removeprefix("model.").removeprefix("_orig_mod."): v for k, v in checkpoint["state_dict"].items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # missing, unexpected or differently shaped tensors
        saved = checkpoint.get("model_config")
        differences = model_config_mismatch(saved, asdict(model.config)) if isinstance(saved, dict) else []
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]  # a heading, then one line per key
        detail = ", ".join(differences) or lines[min(1, len(lines) - 1)][:200]
        raise UserError(f"{source} is of another model: {detail}") from None


def load_model(path: Path, key: str = "ckpts") -> GPT:
    """A GPT from a Lightning checkpoint of `xsa-lm train` (weights only: no code is unpickled). `key` is the
    command's option that named the file, for the error messages."""
    check_checkpoint_file(path, key)
    try:
        if is_sharded(path):  # trainer=fsdp: put back together in this process (the weights only)
            checkpoint = load_sharded(path, optimizer=False)
        else:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError) as e:
        raise UserError(f"{key}: {path} is not a readable checkpoint ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(checkpoint, dict):  # e.g. a bare tensor saved with torch.save
        raise UserError(f"{key}: {path} holds a {type(checkpoint).__name__}, not a checkpoint of `xsa-lm train`")
    stored = checkpoint.get("model_config")
    summary = run_dir_of(path) / "summary.json"
    if stored is None and summary.exists():  # checkpoints written before the config was stored in them
        stored = json.loads(summary.read_text()).get("model_config")
    if not isinstance(stored, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise UserError(f"{key}: {path} has no model config or weights: is it a checkpoint of `xsa-lm train`?")
    try:
        model = GPT(GPTConfig(**stored))  # GPTConfig turns a stored xsa_layers list back into a tuple
    except (TypeError, ValueError) as e:  # a field this version does not know, or an invalid value
        raise UserError(f"{key}: {path} stores a model config this version cannot build ({e})") from None
    load_weights(model, checkpoint, f"{key}: checkpoint {path}")
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
