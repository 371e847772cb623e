"""The output layer's cross-entropy a chunk of tokens at a time, without the whole micro-batch's logits or their
gradient (GPT-2's vocabulary at 8 x 2048 tokens: 1.65 GB of bf16 logits; eager, three fp32 buffers of twice that in
the backward). Liger-Kernel's fused linear cross-entropy, in torch: torch ships none. Training: each chunk's logits make
its loss and, at once, its share of the gradients (the loss is a mean: its gradient is known up to the scalar the
backward brings), so only grad_x (tokens x d_model) and grad_W (vocab x d_model, fp32) wait for the backward. Under
autocast the matmuls run in its dtype and the softmax in fp32, as in the plain loss."""

import torch
import torch.nn.functional as F

IGNORE = -1  # a target counted nowhere


class LinearCrossEntropy(torch.autograd.Function):
    """(mean loss, per-token losses) of x @ weight.T against targets, chunk tokens at a time."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        xc, wc = x.to(dtype), weight.to(dtype)
        counted = targets != IGNORE
        scale = 1.0 / counted.sum()  # the mean's weight of each counted token
        token_losses = torch.empty(targets.shape, dtype=torch.float32, device=x.device)
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if grads else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if grads else None
        with torch.autocast(device, enabled=False):
            for start in range(0, targets.numel(), chunk):
                rows = slice(start, start + chunk)
                token_losses[rows] = chunk_loss(xc[rows], wc, targets[rows], scale, grad_x, grad_w, rows)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype  # 16-bit weights (bf16-true) take the fp32 sum rounded
        ctx.mark_non_differentiable(token_losses)
        return token_losses.sum() * scale, token_losses

    @staticmethod
    def backward(
        ctx, grad_loss: torch.Tensor, _: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        grad_x, grad_w = ctx.saved_tensors  # scaled in place: a second backward fails autograd's version check
        return grad_x.mul_(grad_loss), grad_w.mul_(grad_loss).to(ctx.weight_dtype), None, None


def chunk_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    grad_x: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    rows: slice,
) -> torch.Tensor:
    """One chunk's token losses; with grad_x and grad_w, its rows of grad_x and its share of grad_w, the mean's
    gradient (each counted token weighs `scale`). A function of its own: its buffers are freed before the next."""
    keep, t = targets != IGNORE, targets.clamp(min=0).unsqueeze(1)
    log_probs = F.log_softmax(F.linear(x, weight).float(), dim=-1)  # two fp32 chunks at most
    losses = -log_probs.gather(1, t).squeeze(1) * keep
    if grad_x is not None and grad_w is not None:
        grad = log_probs.exp_().scatter_add_(1, t, -keep.unsqueeze(1).float())  # softmax - one-hot, in place
        grad = grad.mul_(keep.unsqueeze(1) * scale).to(x.dtype)
        grad_x[rows] = grad @ weight
        grad_w.add_((x.t() @ grad).t())  # not grad.t() @ x: that copies the chunk first (CPU, 16 bits)
    return losses


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, per-token losses, 0 where the target is -1) of the logits x @ weight.T, made `chunk`
    tokens at a time; x (..., d), targets (...)."""
    mean, token_losses = LinearCrossEntropy.apply(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1), chunk)
    return mean, token_losses.view(targets.shape)
