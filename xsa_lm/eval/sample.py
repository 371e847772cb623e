"""`xsa-lm generate ckpt=... prompt="..." max_new_tokens=... temperature=... top_k=...`: text from a checkpoint."""

from pathlib import Path
from typing import Annotated

import hydra
import torch
from omegaconf import DictConfig
from pydantic import Field

from xsa_lm.checkpoints.load import load_model, load_tokenizer
from xsa_lm.config.spec import Count, Seed, Spec, parse, rule
from xsa_lm.data.tokenizer import eot_id
from xsa_lm.errors import UserError, one_line_errors
from xsa_lm.model import generate


def _text(value: object) -> str | None:  # Hydra types a value by its look: prompt=1e3 arrives as 1000.0
    quote = "quote one that Hydra reads as a number or boolean, e.g. prompt='\"1e3\"'"
    return None if value is None or isinstance(value, str) else f"prompt must be text: {quote}, got {value!r}"


class GenerateOptions(Spec):
    ckpt: str
    prompt: Annotated[str | None, rule(_text)]  # null: from <|endoftext|>
    max_new_tokens: Count
    # finite: logits / inf is all zeros, a uniform draw whatever top_k says
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    top_k: Count | None
    num_samples: Count
    seed: Seed  # training's range (torch's generator overflows past 2**64)


def sample(
    ckpt: str, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int | None, num_samples: int, seed: int
) -> list[str]:
    path = Path(ckpt).expanduser()
    model, tokenizer = load_model(path, key="ckpt"), load_tokenizer(path, key="ckpt")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids or [eot_id(tokenizer)]
    idx, model = torch.tensor([ids], device=device), model.to(device)
    # Sample i draws from the i-th seed of `seed`'s sequence, one sample at a time: the same text whatever num_samples.
    seeds = torch.randint(2**62, (num_samples,), generator=torch.Generator().manual_seed(seed)).tolist()
    draw = dict(temperature=temperature, top_k=top_k, vocab_size=tokenizer.get_vocab_size())
    try:
        rows = [
            generate(model, idx, max_new_tokens, generator=torch.Generator(device).manual_seed(s), **draw)
            for s in seeds
        ]
    except FloatingPointError as e:  # finite on load_model's check, not on this text
        why = f"{e} on this prompt (a diverged run's weights): use an earlier checkpoint"
        raise UserError(f"ckpt: {path}: {why}") from None
    return [prompt + tokenizer.decode(row[0, len(ids) :].tolist()) for row in rows]


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="generate")
@one_line_errors
def main(cfg: DictConfig) -> None:
    options = parse(GenerateOptions, cfg)  # before the checkpoint is read
    how = options.model_dump(include={"max_new_tokens", "temperature", "top_k", "num_samples", "seed"})
    for i, text in enumerate(sample(options.ckpt, options.prompt or "", **how)):
        print(f"--- sample {i} ---\n{text}")
