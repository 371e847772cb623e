"""`xsa-lm export ckpt=PATH out=DIR`: a checkpoint of `xsa-lm train` as a transformers model with its run's tokenizer
and modelling code, for AutoModelForCausalLM / AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)."""

import importlib.util
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig
from tokenizers import Tokenizer

from xsa_lm.checkpoints.load import load_model, load_tokenizer
from xsa_lm.config.spec import Spec, parse
from xsa_lm.data.tokenizer import EOT, eot_id
from xsa_lm.errors import UserError, one_line_errors
from xsa_lm.model import GPT, GPTConfig
from xsa_lm.model.config import BUILT_IN
from xsa_lm.model.xsa import exclusive_layers

if TYPE_CHECKING:  # transformers is imported only when exporting: it is an extra
    from transformers import PreTrainedTokenizerFast

    from xsa_lm.export.modeling_xsa import XSAForCausalLM

TRANSFORMERS_REQUIREMENT = "transformers>=5.24,<6"  # the extra `eval` of pyproject.toml (5.24: tested)


class ExportOptions(Spec):
    ckpt: str
    out: str | None


def require(module: str, name: str, requirement: str, needed_by: str) -> None:
    """A package of the extra `eval` (about 30 packages for two commands), asked for before any checkpoint is read."""
    if importlib.util.find_spec(module) is None:
        install = f"pip install '{requirement}' (in a checkout: pip install -e '.[eval]')"
        raise UserError(f"{needed_by} needs {name}, the extra `eval`: {install}")


def require_transformers() -> None:
    require("transformers", "transformers", TRANSFORMERS_REQUIREMENT, "xsa-lm export")


def hf_model(model: GPT, eot: int, tokenizer_vocab: int) -> "XSAForCausalLM":
    """The same weights under the same names in an XSAForCausalLM, fp32; generate() never draws padding ids."""
    from xsa_lm.export.configuration_xsa import XSAConfig
    from xsa_lm.export.modeling_xsa import XSAForCausalLM

    config = XSAConfig(**hf_fields(model.config), bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    # auto_map in config.json, and save_pretrained copies the two code files beside the weights
    XSAConfig.register_for_auto_class()
    XSAForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    hf = XSAForCausalLM(config)
    hf.load_state_dict(model.state_dict())  # strict: every tensor, same names and shapes
    if tokenizer_vocab < config.vocab_size:  # generation_config.json: transformers' own way to leave ids out
        hf.generation_config.suppress_tokens = list(range(tokenizer_vocab, config.vocab_size))
    return hf.eval()


def hf_fields(config: GPTConfig) -> dict[str, Any]:
    """XSAConfig's fields of a model: modeling_xsa.py holds the built-in variants only (the exported code stands alone,
    without xsa-lm), so a lab's own is refused."""
    built_in = {target: name for name, target in BUILT_IN.items()}
    if config.attention_target not in built_in:
        raise UserError(
            f"ckpt: attention {config.attention} ({config.attention_target}) is a lab's own variant; export writes "
            f"the built-in ones only ({', '.join(BUILT_IN)}), whose code it ships beside the weights"
        )
    fields = {
        k: v for k, v in asdict(config).items() if k not in ("attention_target", "attention_options", "loss_chunk")
    }
    options = {"eps": 1e-6, "layers": "all", "gate": "none", **config.attention_options}  # XSA's defaults
    layers = exclusive_layers(options["layers"], config.n_layer)
    every = layers == tuple(range(config.n_layer))
    fields.update(
        attention=built_in[config.attention_target], xsa_eps=options["eps"], xsa_gate=options["gate"] == "tanh"
    )
    return fields | {"xsa_layers": None if every else list(layers)}  # JSON: a list


def hf_tokenizer(tokenizer: Tokenizer, block_size: int) -> "PreTrainedTokenizerFast":
    """The run's tokenizer as transformers' own: <|endoftext|> begins, ends and pads (GPT-2's way)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT, pad_token=EOT, model_max_length=block_size
    )


def export(ckpt: Path, out: Path) -> Path:
    require_transformers()
    out = out.resolve() if out.is_symlink() else out  # a link to an empty directory: fill that directory
    # Never overwritten: a file, a non-empty directory, or the current one or above (a rename cannot replace it).
    if out.name in ("", "..") or out.resolve() in (Path.cwd().resolve(), *Path.cwd().resolve().parents):
        shown = str(out) if str(out) != "." else ""
        raise UserError(f"out={shown} is empty, the current directory or one above it: give a new one, e.g. out=hf/xsa")
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    if not existing.is_dir() or (existing == out and any(out.iterdir())):
        what = "is a file, not a directory" if not existing.is_dir() else "exists and is not empty"
        raise UserError(f"out: {existing} {what}; choose another directory (nothing is overwritten)")
    model, tokenizer = load_model(ckpt, key="ckpt"), load_tokenizer(ckpt, key="ckpt")
    hf_fields(model.config)  # a variant it cannot export: refused before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside `out`, then renamed into place: a failed export leaves no half-written model behind.
    staging = out.parent / f".{out.name}.{os.getpid()}"  # mkdir's permissions, as `out`'s would be
    staging.mkdir()
    try:
        hf_model(model, eot_id(tokenizer), tokenizer.get_vocab_size()).save_pretrained(staging)
        hf_tokenizer(tokenizer, model.config.block_size).save_pretrained(staging)
        staging.replace(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="export")
@one_line_errors
def main(cfg: DictConfig) -> None:
    options = parse(ExportOptions, cfg)
    out = export(Path(options.ckpt).expanduser(), Path(options.out or "").expanduser())
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(
        f"wrote {out} ({size:.1f} MiB): load it with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) "
        "and AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)"
    )
