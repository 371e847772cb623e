"""The paper's Figure 1 diagnostics ("attention similarity bias"), per layer, for SA and XSA models alike; averaged
over heads and sequences (each (sequence, head) pair weighs the same):
  cos_v_v       mean cos(v_i, v_j) over token pairs i < j
  a_ii          mean attention of a token on itself, over positions after the first token
  cos_y_v       mean cos(y_i, v_i), y the attention output before the XSA step
  cos_z_v       mean cos(z_i, v_i), z the variant's head outputs (XSA: ~0 by construction, gated XSA: not; layers
                whose head outputs are y, as SA's: none)
  norm_removed  mean 1 - ||z_i|| / ||y_i||: the share of y's norm the variant's step removes (where z is not y)
Attention sinks are keys like any other, but never positions i. Nothing T x T is kept (cos_v_v from
||sum_i v_i/||v_i||||^2, a_ii over chunks of queries), so it runs at the paper's 2048-16384 contexts."""

import math
from collections.abc import Iterable
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F

from xsa_lm.model import GPT
from xsa_lm.model.attention import CausalSelfAttention

METRICS = ("cos_v_v", "a_ii", "cos_y_v", "cos_z_v", "norm_removed")


def mean_pairwise_cosine(v: torch.Tensor) -> torch.Tensor:
    """Mean cos(v_i, v_j) over i < j for v of shape (..., T, D), in O(T): sum_{i<j} = (||S||^2 - sum ||u_i||^2) / 2."""
    u, T = F.normalize(v.float(), dim=-1), v.size(-2)
    pair_sum = (u.sum(dim=-2).pow(2).sum(-1) - u.pow(2).sum((-1, -2))) / 2
    return pair_sum / (T * (T - 1) / 2)


def self_attention_weights(q: torch.Tensor, k: torch.Tensor, first: int, chunk: int = 256) -> torch.Tensor:
    """a_ii = softmax_j(q_i . k_j / sqrt(D))_{j=i} under the causal mask, (B, H, L - first) for positions i >= first
    of q, k (B, H, L, D); one (chunk x L) block of scores per head at a time."""
    q, k, L = q.float(), k.float(), q.size(-2)
    scale, out = 1.0 / math.sqrt(q.size(-1)), []
    for start in range(first, L, chunk):
        stop = min(start + chunk, L)
        scores = q[..., start:stop, :] @ k[..., :stop, :].transpose(-1, -2) * scale  # (B, H, C, stop)
        rows = torch.arange(start, stop, device=q.device).unsqueeze(-1)
        scores = scores.masked_fill(torch.arange(stop, device=q.device) > rows, float("-inf"))
        diagonal = (q[..., start:stop, :] * k[..., start:stop, :]).sum(-1) * scale
        out.append(torch.exp(diagonal - torch.logsumexp(scores, dim=-1)))
    return torch.cat(out, dim=-1)


def layer_statistics(q, k, v, y, *, z, n_sinks: int = 0, chunk: int = 256) -> dict[str, torch.Tensor]:
    """Every metric of one layer as (B, H) tensors. k and v may have fewer (grouped) heads than q and y."""
    groups = q.size(1) // k.size(1)
    if groups > 1:  # diagnostics only: copying is fine here (training broadcasts instead)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    v, y, tokens = v.float(), y.float(), slice(n_sinks, None)
    stats = {
        "cos_v_v": mean_pairwise_cosine(v[..., tokens, :]),
        "a_ii": self_attention_weights(q, k, first=n_sinks + 1, chunk=chunk).mean(-1),
        "cos_y_v": F.cosine_similarity(y[..., tokens, :], v[..., tokens, :], dim=-1, eps=1e-12).mean(-1),
    }
    if z is not None:  # from the second token on: the first sees only itself (y = v), its z ~0 points nowhere
        z, y, v = (t[..., n_sinks + 1 :, :].float() for t in (z, y, v))
        stats["cos_z_v"] = F.cosine_similarity(z, v, dim=-1, eps=1e-12).mean(-1)
        stats["norm_removed"] = (1 - z.norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)).mean(-1)
    return stats


@torch.no_grad()
def diagnose(model: GPT, batches: Iterable[torch.Tensor], chunk: int = 256) -> list[dict]:
    """One row per layer with every metric over batches of token ids (B, T) (cos_z_v, norm_removed: None in SA). A
    layer is labelled with the model's attention where its head outputs differ from y, else sa."""
    values: list[dict[str, list[torch.Tensor]]] = [{name: [] for name in METRICS} for _ in model.blocks]

    def observe(layer: int, q, k, v, y, z) -> None:
        for name, value in layer_statistics(q, k, v, y, z=z, n_sinks=model.config.n_sinks, chunk=chunk).items():
            values[layer][name].append(value.flatten().double())

    attentions = [cast(CausalSelfAttention, block.attn) for block in model.blocks]  # nn.ModuleList is untyped
    was_training = model.training
    model.eval()
    try:
        for layer, attn in enumerate(attentions):
            attn.observer = partial(observe, layer)
        for batch in batches:
            model(batch)
    finally:
        for attn in attentions:
            attn.observer = None
        model.train(was_training)
    return [
        {"layer": layer, "attention": model.config.attention if values[layer]["cos_z_v"] else "sa"}
        | {name: torch.cat(seen).mean().item() if seen else None for name, seen in values[layer].items()}
        for layer in range(len(attentions))
    ]
