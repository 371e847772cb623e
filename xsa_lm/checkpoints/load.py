"""Checkpoints of `xsa-lm train` as models, with their run's tokenizer and data, for analyze, eval, generate, export."""

import json
import pickle
import zipfile
from collections import Counter
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import torch
from omegaconf import OmegaConf
from pydantic import BeforeValidator
from tokenizers import Tokenizer

from xsa_lm.checkpoints.sharded import META, is_sharded, load_sharded, shards_complete
from xsa_lm.compat import COMPILED_PREFIX
from xsa_lm.config.spec import DataSpec, TokenizerSpec, parse
from xsa_lm.data.prepare import PreparedData, load_prepared
from xsa_lm.data.tokenizer import file_sha256, read_tokenizer
from xsa_lm.errors import UserError
from xsa_lm.model import GPT, GPTConfig


def _texts(value: object) -> object:
    return value if value is None else [str(v) for v in (value if isinstance(value, list | tuple) else [value])]


Texts = Annotated[list[str], BeforeValidator(_texts)]  # a list option given as one value (ckpts=PATH), or numbers


def check_checkpoint_file(path: Path, key: str = "ckpts") -> None:
    """Refuse in one line anything that cannot be a checkpoint (checked before any slow work)."""
    if is_sharded(path):
        if not shards_complete(path):
            raise UserError(f"{key}: {path} is an incomplete sharded checkpoint (a shard is missing or truncated)")
        return
    if path.is_dir():
        inside = (p for p in (path / "checkpoints" / "last.ckpt", path / "last.ckpt") if p.exists())
        example = next(inside, "runs/sa/checkpoints/last.ckpt")
        raise UserError(f"{key}: {path} is a directory, not a checkpoint: give a .ckpt file, e.g. {example}")
    if path.exists() and not path.is_file():
        raise UserError(f"{key}: {path} is not a regular file (a device, pipe or socket), not a checkpoint")
    if not path.is_file():
        raise UserError(f"{key}: checkpoint not found: {path}")
    if path.stat().st_size == 0:
        raise UserError(f"{key}: {path} is empty, not a checkpoint")
    # torch.save writes zip archives; torch.load reads anything else as a legacy pickle, failing in arbitrary ways
    if not zipfile.is_zipfile(path):
        raise UserError(
            f"{key}: {path} is not a checkpoint of `xsa-lm train` (not a torch.save file, or truncated): "
            "give a .ckpt file from <run dir>/checkpoints/"
        )


def checkpoint_list(ckpts: list[str]) -> list[str]:
    """Each a checkpoint, each once (its rows would count twice in a mean)."""
    if not ckpts:
        raise UserError("ckpts: give at least one checkpoint, e.g. ckpts=[runs/sa/checkpoints/last.ckpt]")
    seen: dict[Path, str] = {}
    for ckpt in ckpts:
        check_checkpoint_file(Path(ckpt).expanduser())
        resolved = Path(ckpt).expanduser().resolve()
        if resolved in seen:
            again = "twice" if ckpt == seen[resolved] else f"twice ({seen[resolved]} and {ckpt})"
            raise UserError(f"ckpts: {resolved} is given {again}: give each checkpoint once")
        seen[resolved] = ckpt
    return ckpts


def told_apart(labels: list[str], paths: list[Path], last_resort: list[str]) -> list[str]:
    """Labels told apart by the file name where alike (one run's), then by `last_resort` (runs of one name)."""
    counts = Counter(labels)
    labels = [f"{label} {path.stem}" if counts[label] > 1 else label for label, path in zip(labels, paths, strict=True)]
    counts = Counter(labels)
    return [last if counts[label] > 1 else label for label, last in zip(labels, last_resort, strict=True)]


def run_dir_of(path: Path) -> Path:
    """The folder above its checkpoints/, or the one holding it beside config.yaml (a consolidated checkpoint)."""
    beside = path.parent.name != "checkpoints" and (path.parent / "config.yaml").is_file()
    return path.parent if beside else path.parent.parent


def model_config_mismatch(saved: dict, expected: dict) -> list[str]:
    """Each GPTConfig field the stored `model_config` differs in, as `d_model: 128 -> 64`: resuming keeps the model."""

    def normalised(config: dict) -> dict[str, str]:  # as GPTConfig holds it (defaults, a saved legacy form), as text
        with suppress(TypeError, ValueError):  # a field GPTConfig does not know, or an invalid value: as stored
            config = asdict(GPTConfig(**config))
        return {k: str(list(v)) if isinstance(v, tuple) else str(v) for k, v in config.items()}

    saved, expected = normalised(saved), normalised(expected)
    differing = [k for k in dict.fromkeys([*expected, *saved]) if saved.get(k) != expected.get(k)]
    return [f"{k}: {saved.get(k, '(absent)')} -> {expected.get(k, '(absent)')}" for k in differing]


def load_model(path: Path, key: str = "ckpts") -> GPT:
    """A GPT from a checkpoint of `xsa-lm train` (weights only: no code is unpickled); `key` names the option."""
    check_checkpoint_file(path, key)
    try:  # trainer=fsdp's shards are put back together in this process (the weights only)
        sharded = is_sharded(path)
        checkpoint = load_sharded(path, optimizer=False) if sharded else torch.load(path, "cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError) as e:
        raise UserError(f"{key}: {path} is not a readable checkpoint ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(checkpoint, dict):  # e.g. a bare tensor saved with torch.save
        raise UserError(f"{key}: {path} holds a {type(checkpoint).__name__}, not a checkpoint of `xsa-lm train`")
    stored, weights = checkpoint.get("model_config"), checkpoint.get("state_dict")
    if not isinstance(stored, dict) or not isinstance(weights, dict):
        raise UserError(f"{key}: {path} has no model config or weights: is it a checkpoint of `xsa-lm train`?")
    try:
        config = GPTConfig(**stored)  # one saved before variants were classes too (attention sa/xsa, xsa_* fields)
    except (TypeError, ValueError) as e:  # a field this version lacks, or a lab's variant not importable here
        raise UserError(f"{key}: {path}'s model config builds no model here: {e}") from None
    model = GPT(config)
    # Lightning prefixes the module's attribute (`model.`); a torch.compile(model) wrapper added its own.
    state = {k.removeprefix("model.").removeprefix(COMPILED_PREFIX): v for k, v in weights.items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # missing, unexpected or differently shaped tensors: a heading, then a line per key
        first = [line.strip() for line in str(e).splitlines() if line.strip()][1:2] or [str(e)]
        raise UserError(f"{key}: {path} holds weights of another model than its config: {first[0][:200]}") from None
    with torch.no_grad():  # weights that are NaN, or finite but large enough to overflow in one forward
        finite = torch.isfinite(model(torch.zeros(1, 1, dtype=torch.long))[0]).all()
    if not finite:
        why = "gives NaN or infinite logits (a diverged run's weights): use an earlier checkpoint"
        raise UserError(f"{key}: {path} {why}")
    return model


def load_tokenizer(path: Path, key: str = "ckpts") -> Tokenizer:
    """The run's tokenizer: saved with its prepared data, else that of the data prepared again (run_data)."""
    data_dir = _run_data_dir(path, key)
    saved = data_dir / "tokenizer.json" if data_dir else None
    if saved and saved.is_file():
        tokenizer = read_tokenizer(saved, key)
        check_tokenizer(path, tokenizer, file_sha256(saved, key), saved, key)
        return tokenizer
    return run_data(path, key).tokenizer


def run_data(path: Path, key: str = "ckpts") -> PreparedData:
    """The run's prepared data: its folder, else prepared again from config.yaml; refused with another tokenizer."""
    data_dir = _run_data_dir(path, key)
    rebuilt = ""
    if data_dir and (data_dir / "meta.json").is_file():
        data = load_prepared(data_dir)
    else:
        from xsa_lm.data.run import prepare_data

        saved = run_config(path, key)
        given = settings_as_started(saved["data"], saved["tokenizer"], run_dir_of(path), key)
        data = prepare_data(parse(DataSpec, given[0], at="data."), parse(TokenizerSpec, given[1], at="tokenizer."))
        gone = f": the run's data folder {data_dir} is gone" if data_dir else ""
        rebuilt = f" (prepared again from {run_dir_of(path) / 'config.yaml'}{gone})"
    check_tokenizer(path, data.tokenizer, data.tokenizer_sha256, data.dir / "tokenizer.json", key, rebuilt=rebuilt)
    return data


def run_config(path: Path, key: str = "ckpts") -> dict[str, Any]:
    """The config.yaml of the checkpoint's run, as a plain dict."""
    saved = run_dir_of(path) / "config.yaml"
    if not saved.is_file() and path.parent.name != "checkpoints":
        raise UserError(
            f"{key}: {path} is neither in a run's checkpoints/ folder nor beside its config.yaml: the run's data "
            "settings and tokenizer are read from <run dir>/config.yaml; put the file in its run's folder"
        )
    if not saved.is_file():
        raise UserError(f"{key}: {saved} not found: the run's data settings (and its tokenizer) are read from it")
    return OmegaConf.to_container(OmegaConf.load(saved), resolve=True)  # type: ignore[return-value]  # a mapping


def _run_info(run_dir: Path, key: str) -> dict:
    info = run_dir / "run_info.json"
    try:
        recorded = json.loads(info.read_bytes()) if info.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{key}: {info} is not valid JSON (truncated or overwritten?)") from None
    return recorded if isinstance(recorded, dict) else {}


def _run_data_dir(path: Path, key: str) -> Path | None:
    """The prepared-data folder run_info.json records (maybe gone since), a relative one from the run's cwd."""
    recorded = _run_info(run_dir_of(path), key)
    return (Path(recorded.get("cwd") or ".") / recorded["data_dir"]).resolve() if recorded.get("data_dir") else None


def settings_as_started(
    data: dict[str, Any], tokenizer: dict[str, Any], run_dir: Path, key: str = "resume"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's data and tokenizer settings, their relative paths from the run's cwd (run_info.json) as back then."""
    cwd = str(_run_info(run_dir, key).get("cwd") or "")

    def rebased(value: Any, keys: tuple[str, ...], is_path: bool = False) -> Any:  # a data.source's own keys too
        if isinstance(value, dict):
            return {k: rebased(v, keys, is_path or k in keys) for k, v in value.items()}
        if isinstance(value, list):
            return [rebased(v, keys, is_path) for v in value]
        relative = is_path and isinstance(value, str) and value != "" and not Path(value).expanduser().is_absolute()
        return str(Path(cwd) / value) if relative else value

    paths = ("dir", "cache_dir", "files", "data_files")  # the data settings that name files
    return (rebased(data, paths), rebased(tokenizer, ("path",))) if cwd else (data, tokenizer)


def check_tokenizer(path: Path, tokenizer: Tokenizer, sha256: str, where: Path, key: str, rebuilt: str = "") -> None:
    """Refuse a tokenizer (from `where`; `rebuilt`: how made again) other than the one the checkpoint records."""
    meta = path / META if is_sharded(path) else path  # read memory-mapped: a large file is not read
    # Lightning saves the data module's state under its class name (TokenDataModule: not imported, it takes seconds)
    state = torch.load(meta, map_location="cpu", weights_only=True, mmap=True).get("TokenDataModule") or {}
    recorded = state.get("tokenizer_sha256")
    if recorded is not None and recorded != sha256:
        raise UserError(
            f"{key}: {path} was trained with another tokenizer (sha256 {recorded[:12]}) than {where} "
            f"(sha256 {sha256[:12]}){rebuilt}: restore the data folder or the source files it was trained on"
        )
