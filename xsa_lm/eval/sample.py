"""`xsa-lm generate ckpt=... prompt="..." max_new_tokens=... temperature=... top_k=...`: text from a checkpoint."""

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from xsa_lm.checkpoints import load_model, load_tokenizer
from xsa_lm.data.tokenizer import EOT
from xsa_lm.errors import UserError, exit_on_user_error
from xsa_lm.model import generate


def sample(ckpt: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, num_samples: int,
           seed: int) -> list[str]:  # fmt: skip
    if max_new_tokens < 1 or num_samples < 1 or temperature < 0:
        raise UserError("max_new_tokens and num_samples must be >= 1 and temperature >= 0")
    path = Path(ckpt).expanduser()
    model, tokenizer = load_model(path), load_tokenizer(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids or [tokenizer.token_to_id(EOT)]
    idx = torch.tensor([ids] * num_samples, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = generate(model.to(device), idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return [prompt + tokenizer.decode(row[len(ids) :].tolist()) for row in tokens]


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        texts = sample(cfg.ckpt, cfg.prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.num_samples, cfg.seed)
    for i, text in enumerate(texts):
        print(f"--- sample {i} ---\n{text}")
