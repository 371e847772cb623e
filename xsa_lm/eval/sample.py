"""`xsa-lm generate ckpt=... prompt="..." max_new_tokens=... temperature=... top_k=...`: text from a checkpoint."""

import math
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from xsa_lm.checkpoints.load import load_model, load_tokenizer
from xsa_lm.config.schema import SEED_MAX
from xsa_lm.data.tokenizer import eot_id
from xsa_lm.errors import UserError, exit_on_user_error, one_line_errors
from xsa_lm.model import generate

SETTINGS = ("max_new_tokens", "temperature", "top_k", "num_samples", "seed")  # generate.yaml's sampling options


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sampling(*, max_new_tokens, temperature, top_k, num_samples, seed, prompt="") -> None:
    """The sampling options, one line per mistake, before the checkpoint is read."""
    # Hydra types a value by its look: prompt=1e3 arrives as 1000.0, prompt=true as True, not as what was typed.
    if prompt is not None and not isinstance(prompt, str):
        raise UserError(
            f"prompt must be text, got {prompt!r} (Hydra read it as a {type(prompt).__name__}): quote it for Hydra, "
            f"e.g. prompt='\"1e3\"'"
        )
    for key, value in (("max_new_tokens", max_new_tokens), ("num_samples", num_samples)):
        if not is_int(value) or value < 1:
            raise UserError(f"{key} must be an integer >= 1, got {value!r}")
    # not finite: logits / inf is all zeros, a uniform draw whatever top_k says
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature < math.inf:
        raise UserError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise UserError(f"top_k must be an integer >= 1, or null for the whole vocabulary, got {top_k!r}")
    if not is_int(seed) or not 0 <= seed <= SEED_MAX:  # training's range (torch's generator overflows past 2**64)
        raise UserError(f"seed must be an integer from 0 to {SEED_MAX}, as training's, got {seed!r}")


def sample(
    ckpt: str, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int | None, num_samples: int, seed: int
) -> list[str]:
    """`num_samples` continuations of `prompt` by the checkpoint's model (check_sampling has checked the options)."""
    path = Path(str(ckpt)).expanduser()
    model, tokenizer = load_model(path, key="ckpt"), load_tokenizer(path, key="ckpt")
    prompt = prompt or ""  # prompt=null
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids or [eot_id(tokenizer)]
    idx = torch.tensor([ids], device=device)
    model = model.to(device)
    # Sample i draws from the i-th seed of `seed`'s sequence, one sample at a time: the same text whatever num_samples.
    seeds = torch.randint(2**62, (num_samples,), generator=torch.Generator().manual_seed(seed)).tolist()
    texts = []
    for each in seeds:
        generator = torch.Generator(device=device).manual_seed(each)
        (row,) = generate(
            model,
            idx,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            generator=generator,
            vocab_size=tokenizer.get_vocab_size(),
        )
        texts.append(prompt + tokenizer.decode(row[len(ids) :].tolist()))
    return texts


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="generate")
@one_line_errors
def main(cfg: DictConfig) -> None:
    settings = {key: cfg[key] for key in SETTINGS}
    with exit_on_user_error():
        check_sampling(prompt=cfg.prompt, **settings)  # before the checkpoint is read
        texts = sample(cfg.ckpt, cfg.prompt, **settings)
    for i, text in enumerate(texts):
        print(f"--- sample {i} ---\n{text}")
