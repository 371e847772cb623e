"""`xsa-lm export ckpt=PATH out=DIR`: a checkpoint of `xsa-lm train` as a Hugging Face transformers model, with the
run's tokenizer and the modelling code (configuration_xsa.py, modeling_xsa.py), loaded offline with
AutoModelForCausalLM / AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)."""

import importlib.util
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig
from pydantic import Field
from tokenizers import Tokenizer

from xsa_lm.checkpoints.load import Options, check_checkpoint_file, load_model, load_tokenizer, parse_options
from xsa_lm.data.tokenizer import EOT, eot_id
from xsa_lm.errors import UserError, exit_on_user_error, one_line_errors
from xsa_lm.model import GPT

if TYPE_CHECKING:  # transformers is imported only when exporting: it is an extra
    from transformers import PreTrainedTokenizerFast

    from xsa_lm.export.modeling_xsa import XSAForCausalLM

TRANSFORMERS_REQUIREMENT = "transformers>=5.24,<6"  # the extra `eval` of pyproject.toml (5.24: tested)


class ExportOptions(Options):
    ckpt: str = Field(description="the path of a checkpoint")
    out: str | None = Field(description="the path of the directory to write")


def require_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        raise UserError(
            f"xsa-lm export needs transformers, in the extra `eval`: pip install '{TRANSFORMERS_REQUIREMENT}' "
            "(in a checkout: pip install -e '.[eval]')"
        )


def check_out(out: Path) -> None:
    """Never overwritten: a file, a non-empty directory, or the current one or above (a rename cannot replace it)."""
    if out.name in ("", "..") or out.resolve() in (Path.cwd().resolve(), *Path.cwd().resolve().parents):
        raise UserError(
            f"out={str(out) if str(out) != '.' else ''} is empty, the current directory or one above it: give the "
            "new directory to write the model to, e.g. out=hf/xsa"
        )
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    if not existing.is_dir():
        raise UserError(
            f"out: {existing} is a file, not a directory; choose another directory (nothing is overwritten)"
        )
    if existing == out and any(out.iterdir()):
        raise UserError(f"out: {out} exists and is not empty; choose another directory (nothing is overwritten)")


def hf_model(model: GPT, eot: int, tokenizer_vocab: int) -> "XSAForCausalLM":
    """The same weights under the same names in an XSAForCausalLM, fp32; generate() never draws padding ids."""
    from xsa_lm.export.configuration_xsa import XSAConfig
    from xsa_lm.export.modeling_xsa import XSAForCausalLM

    fields = asdict(model.config)
    fields["xsa_layers"] = None if fields["xsa_layers"] is None else list(fields["xsa_layers"])  # JSON: a list
    config = XSAConfig(**fields, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    # auto_map in config.json, and save_pretrained copies the two code files beside the weights
    XSAConfig.register_for_auto_class()
    XSAForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    hf = XSAForCausalLM(config)
    hf.load_state_dict(model.state_dict())  # strict: every tensor, same names and shapes
    if tokenizer_vocab < config.vocab_size:  # generation_config.json: transformers' own way to leave ids out
        hf.generation_config.suppress_tokens = list(range(tokenizer_vocab, config.vocab_size))
    return hf.eval()


def hf_tokenizer(tokenizer: Tokenizer, block_size: int) -> "PreTrainedTokenizerFast":
    """The run's tokenizer as transformers' own: <|endoftext|> begins, ends and pads (GPT-2's way)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT, pad_token=EOT, model_max_length=block_size
    )


def export(ckpt: Path, out: Path) -> Path:
    require_transformers()
    check_checkpoint_file(ckpt, key="ckpt")
    out = out.resolve() if out.is_symlink() else out  # a link to an empty directory: fill that directory
    check_out(out)
    model, tokenizer = load_model(ckpt, key="ckpt"), load_tokenizer(ckpt, key="ckpt")
    eot = eot_id(tokenizer)  # read_tokenizer refused a run's tokenizer without one
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside `out`, then renamed into place: a failed export leaves no half-written model behind.
    staging = out.parent / f".{out.name}.{os.getpid()}"  # mkdir's permissions, as `out`'s would be
    staging.mkdir()
    try:
        hf_model(model, eot, tokenizer.get_vocab_size()).save_pretrained(staging)
        hf_tokenizer(tokenizer, model.config.block_size).save_pretrained(staging)
        staging.replace(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="export")
@one_line_errors
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        options = parse_options(ExportOptions, cfg)
        out = export(Path(options.ckpt).expanduser(), Path(options.out or "").expanduser())
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(
        f"wrote {out} ({size:.1f} MiB): load it with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) "
        "and AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)"
    )
