"""Sampling from a GPT, with a KV cache: each new token costs one position of attention, not the whole context."""

import torch

from xsa_lm.model.attention import KVCache
from xsa_lm.model.gpt import GPT


@torch.no_grad()
@torch.compiler.set_stance("force_eager")  # on a compiled model each new length would compile again: not worth it
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """idx (B, T) and max_new_tokens more: greedy at temperature 0, else drawn from the top_k, seeing the last
    block_size tokens; never ids from vocab_size on (the table's padding). Callers check temperature and top_k.
    FloatingPointError: the logits are not finite (the weights of a diverged run)."""
    was_training = model.training
    model.eval()
    block = model.config.block_size
    tokens, caches, fed = idx, None, 0  # fed: tokens of `tokens` already in the caches
    try:
        for _ in range(max_new_tokens):
            if use_cache and (caches is None or tokens.size(1) > block):  # start, or the window slid: rebuild
                caches, fed = [KVCache() for _ in model.blocks], max(0, tokens.size(1) - block)
            logits = (model(tokens[:, fed:], caches=caches) if use_cache else model(tokens[:, -block:]))[:, -1].float()
            fed = tokens.size(1)
            if not torch.isfinite(logits).all():  # a diverged model's: no token can be drawn from them
                raise FloatingPointError("the model's logits are NaN or infinite")
            if vocab_size is not None:  # the padding of the embedding table: ids no tokenizer can decode
                logits[:, vocab_size:] = float("-inf")
            if temperature < torch.finfo(logits.dtype).tiny:  # 0, or one fp32 rounds to 0: greedy, the limit
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                # From the largest logit down: a tiny temperature then gives -inf, never inf - inf (NaN), at the others.
                logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(logits.softmax(-1), num_samples=1, generator=generator)
            tokens = torch.cat([tokens, next_token], dim=1)
    finally:
        model.train(was_training)
    return tokens
