"""The held-out loss on token windows: nats per token, bits per byte, the loss per equal span of positions. Validation
(train/module.py) and `xsa-lm analyze` share loss_sums and read_sums: analyze gives a run's own final val/loss."""

import math
from dataclasses import dataclass

import torch

from xsa_lm.model import GPT


@dataclass(frozen=True)
class HeldOutLoss:
    windows: int  # how many windows were measured
    tokens: int  # the targets counted (not -1)
    loss: float  # nats per token
    bpb: float | None  # bits per byte; None without byte lengths (or targets that stand for no bytes)
    by_position: list[float | None]  # the mean loss of each equal span of positions, earliest first; None: no token


def loss_sums(token_loss: torch.Tensor, y: torch.Tensor, *, token_bytes: torch.Tensor, buckets: int) -> torch.Tensor:
    """One batch's float64 sums [nats, tokens, bytes, nats per span..., tokens per span...] of its per-token losses
    (GPT.token_losses; targets of -1 count nowhere); token_bytes[id]: the bytes a token stands for (empty: no bits
    per byte)."""
    counted = y != -1
    span = torch.arange(y.size(1), device=y.device) * buckets // y.size(1)
    zeros = torch.zeros(buckets, device=y.device, dtype=torch.float64)
    span_loss = zeros.index_add(0, span, token_loss.double().sum(0))
    span_tokens = zeros.index_add(0, span, counted.double().sum(0))
    nbytes = token_bytes[y.clamp(min=0)].masked_fill(~counted, 0).sum() if token_bytes.numel() else zeros.sum()
    return torch.cat([torch.stack([span_loss.sum(), span_tokens.sum(), nbytes]), span_loss, span_tokens])


def read_sums(sums: list[float], buckets: int) -> tuple[float, float | None, list[float | None]]:
    """(nats per token, bits per byte or None, mean loss per span or None) of the added-up loss_sums."""
    total, tokens, nbytes = sums[:3]
    spans = zip(sums[3 : 3 + buckets], sums[3 + buckets :], strict=True)
    loss = total / tokens if tokens else math.nan
    return loss, total / (math.log(2) * nbytes) if nbytes else None, [s / t if t else None for s, t in spans]


@torch.no_grad()
def held_out_loss(
    model: GPT, x: torch.Tensor, y: torch.Tensor, *, token_bytes: list[int] | None, buckets: int, batch_size: int
) -> HeldOutLoss:
    """The model's loss on windows x with targets y (B, T), in eval mode; token_bytes: each id's UTF-8 bytes."""
    sums = torch.zeros(3 + 2 * buckets, device=x.device, dtype=torch.float64)
    lengths = torch.tensor(token_bytes or [], device=x.device, dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True):
            sums += loss_sums(model.token_losses(xb, yb), yb, token_bytes=lengths, buckets=buckets)
    finally:
        model.train(was_training)
    loss, bpb, by_position = read_sums(sums.tolist(), buckets)
    return HeldOutLoss(windows=x.size(0), tokens=int(sums[1].item()), loss=loss, bpb=bpb, by_position=by_position)
