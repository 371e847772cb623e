"""`xsa-lm generate ckpt=... prompt="..." max_new_tokens=... temperature=... top_k=...`: text from a checkpoint."""

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from pydantic import Field

from xsa_lm.checkpoints.load import Count, Options, load_model, load_tokenizer, parse_options
from xsa_lm.config.spec import SEED_MAX
from xsa_lm.data.tokenizer import eot_id
from xsa_lm.errors import exit_on_user_error, one_line_errors
from xsa_lm.model import generate


class GenerateOptions(Options):
    ckpt: str
    # Hydra types a value by its look: prompt=1e3 arrives as 1000.0, prompt=true as True, not as what was typed.
    prompt: str | None = Field(
        description="text: quote one that Hydra reads as a number or boolean, e.g. prompt='\"1e3\"'"
    )
    max_new_tokens: Count
    # not finite: logits / inf is all zeros, a uniform draw whatever top_k says
    temperature: float = Field(ge=0, allow_inf_nan=False, description="a finite number >= 0 (0: greedy)")
    top_k: int | None = Field(ge=1, description="an integer >= 1, or null for the whole vocabulary")
    num_samples: Count
    # training's range (torch's generator overflows past 2**64)
    seed: int = Field(ge=0, le=SEED_MAX, description=f"an integer from 0 to {SEED_MAX}, as training's")


def sample(
    ckpt: str, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int | None, num_samples: int, seed: int
) -> list[str]:
    path = Path(ckpt).expanduser()
    model, tokenizer = load_model(path, key="ckpt"), load_tokenizer(path, key="ckpt")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids or [eot_id(tokenizer)]
    idx = torch.tensor([ids], device=device)
    model = model.to(device)
    # Sample i draws from the i-th seed of `seed`'s sequence, one sample at a time: the same text whatever num_samples.
    seeds = torch.randint(2**62, (num_samples,), generator=torch.Generator().manual_seed(seed)).tolist()
    texts = []
    for each in seeds:
        generator, vocab = torch.Generator(device=device).manual_seed(each), tokenizer.get_vocab_size()
        draw = dict(temperature=temperature, top_k=top_k, generator=generator, vocab_size=vocab)
        (row,) = generate(model, idx, max_new_tokens, **draw)
        texts.append(prompt + tokenizer.decode(row[len(ids) :].tolist()))
    return texts


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="generate")
@one_line_errors
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        options = parse_options(GenerateOptions, cfg)  # before the checkpoint is read
        how = options.model_dump(include={"max_new_tokens", "temperature", "top_k", "num_samples", "seed"})
        texts = sample(options.ckpt, options.prompt or "", **how)  # prompt=null: from <|endoftext|>
    for i, text in enumerate(texts):
        print(f"--- sample {i} ---\n{text}")
