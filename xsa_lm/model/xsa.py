"""The XSA step (arXiv 2603.09078, Algorithm 1): remove from each attention output its component along the
token's own value vector. A reference in plain torch, and autograd Functions that keep less memory for the backward.

What the fused path adds to SA in bf16, measured by scripts/bench_xsa_epilogue.py on CPU (E_y: y's size in bytes):
- compiled (inductor): at most one kernel each way, the least XSA needs (it may fuse with a kernel SA has too).
  The forward's kernel reads y and v and writes z and two fp32 numbers per token and head, (y . v) / n and 1 / n;
  the backward's reads grad_z, y, v and those numbers and writes grad_y and one fp32 number per token and head
  (grad_v is folded into the kernel that writes the qkv gradient). No fp32 copy of anything is made. The
  partitioner keeps z for W_o's weight gradient rather than recompute it: E_y more kept per layer, a write of E_y
  less in the backward. Allocations: z and grad_y (E_y each) and those numbers, nothing else.
- eager: z is recomputed in the backward instead, so XSA keeps only the two numbers per token and head. Only v is
  converted to fp32 for the pass; y and the gradient enter each product as they are (type promotion computes in
  fp32; on CPU it copies them for that one op), and the backward works in place where it can. One XSA output
  projection alone, its allocator peak in units of y's bytes (B 2, T 64, 4 heads of 16): bf16 forward 6.25
  (was 7.25 with fp32 copies of y, v and the gradient), backward 8.75 (was 18.9); fp32 backward 3.6 (was 5.7).
  A whole attention layer (12 heads of 64, B 2, T 128) peaks 0.09 of y's bytes above SA in the backward (was 10.1),
  1.09 in the forward (was 2.09).
"""

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from xsa_lm.model.attention import CausalSelfAttention
from xsa_lm.model.config import GPTConfig


def xsa_reference(
    y: torch.Tensor, v: torch.Tensor, eps: float = 1e-6, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """XSA as the paper writes it, left to autograd: z = y - (y . v) / (||v||^2 + eps) v over the last dim.

    eps keeps a zero v from giving NaN. Computed in at least fp32 (bf16 loses the orthogonality), returned in y's
    dtype. v broadcasts against y (grouped-query attention); `scale`, the gated variant's tanh(alpha) per head,
    multiplies the subtracted part.
    """
    dtype = torch.promote_types(y.dtype, torch.float32)  # fp64 stays fp64, for tests
    y32, v32 = y.to(dtype), v.to(dtype)
    coef = (y32 * v32).sum(-1, keepdim=True) / ((v32 * v32).sum(-1, keepdim=True) + eps)
    if scale is not None:
        coef = coef * scale
    return (y32 - coef * v32).to(y.dtype)


# The fused path below computes xsa_reference's z, with a hand-written backward that keeps less memory:
# tests/test_attention.py checks its forward and gradients against xsa_reference (equal to float rounding), with
# GQA broadcasting, the gate and bf16.


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a . b over the last dim, kept. Not torch.linalg.vecdot: autocast runs that in bf16, whatever its inputs."""
    return (a * b).sum(-1, keepdim=True)


def _upcast(v: torch.Tensor) -> torch.Tensor:
    """v in at least fp32 (bf16 loses the orthogonality); fp64 stays fp64, so gradcheck can check the backward. Only v
    is converted: y and the gradient enter each product beside it as they are, type promotion computing in v's dtype
    (exactly: a product of two bf16 numbers fits in fp32), so no fp32 copy of them is ever made."""
    return v.to(torch.promote_types(v.dtype, torch.float32))


def _xsa_forward(
    y: torch.Tensor, v: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z, and for the backward c = (y . v) / n and 1 / n, with n = ||v||^2 + eps (fp32, per token and head)."""
    v32 = _upcast(v)
    inv_norm = 1.0 / (_dot(v32, v32) + eps)
    coef = _dot(y, v32) * inv_norm
    return _subtract(y, v32, coef=coef, scale=scale), coef, inv_norm


def _subtract(y: torch.Tensor, v32: torch.Tensor, coef: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """z = y - scale * coef * v, computed in v32's dtype and returned in y's."""
    return torch.addcmul(y, coef if scale is None else coef * scale, v32, value=-1.0).to(y.dtype)


def _xsa_backward(
    grad: torch.Tensor,
    *,
    y: torch.Tensor,
    v: torch.Tensor,
    scale: torch.Tensor | None,
    coef: torch.Tensor,
    inv_norm: torch.Tensor,
    scale_needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of z with respect to y, v and the gate, given g = dL/dz. Each full-size fp32 temporary is consumed
    before the next is made (eager holds at most one, plus v's fp32 copy); compiled, all of it is one kernel."""
    v32 = _upcast(v)
    g_dot_v = _dot(grad, v32)
    k = g_dot_v * inv_norm if scale is None else g_dot_v * inv_norm * scale  # s (g . v) / n
    c = coef if scale is None else coef * scale
    # dz/dv: -s c g - k y + 2 k c v (the last from differentiating 1 / ||v||^2), in place on the first term
    grad_v = (grad * -c).addcmul_(k, y, value=-1.0).addcmul_(k * coef, v32, value=2.0)
    grad_v = grad_v.sum_to_size(v.shape).to(v.dtype)  # GQA: summed over the query heads that share v
    grad_y = torch.addcmul(grad, k, v32, value=-1.0).to(y.dtype)  # g - k v
    grad_scale = (
        (-(g_dot_v * coef)).sum_to_size(scale.shape).to(scale.dtype) if scale is not None and scale_needs_grad else None
    )
    return grad_y, grad_v, grad_scale


class ExclusiveProjection(torch.autograd.Function):
    """z = xsa_reference(y, v, eps, scale), with a hand-written backward.

    It saves y and v as they came in (bf16 stays bf16; SDPA keeps both for its own backward anyway), the gate, and
    two numbers per token and head, (y . v) / n and 1 / n with n = ||v||^2 + eps: 2 / head_dim of y's size. Autograd
    of the plain formula would keep fp32 copies of y and v (in bf16, 2x y more) and redo more passes over memory.
    torch.compile traces through it (no graph break) and fuses forward and backward into one kernel each.
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, v: torch.Tensor, eps: float, scale: torch.Tensor | None) -> torch.Tensor:
        z, coef, inv_norm = _xsa_forward(y, v, eps=eps, scale=scale)
        ctx.save_for_backward(y, v, scale, coef, inv_norm)
        return z

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, v, scale, coef, inv_norm = ctx.saved_tensors
        grad_y, grad_v, grad_scale = _xsa_backward(
            grad, y=y, v=v, scale=scale, coef=coef, inv_norm=inv_norm, scale_needs_grad=ctx.needs_input_grad[3]
        )
        return grad_y, grad_v, None, grad_scale


class ExclusiveOutputProjection(torch.autograd.Function):
    """out = F.linear(xsa_reference(y, v, eps, scale).flatten(-3), weight, bias), keeping no z for the backward.

    W_o's weight gradient needs its input. For SA that is SDPA's output y, which SDPA keeps anyway; for XSA it would
    be z, one more activation of y's size per layer. So z is recomputed in the backward from y, v and the saved
    coefficients (one elementwise pass, no matmul), and eager XSA costs no activation memory beyond 2 numbers per
    token and head. Under torch.compile the recompute is the forward's z to the partitioner, which keeps z instead
    (see the module docstring). y is (..., H_kv, G, D) and v (..., H_kv, 1, D); the last three dims are flattened into
    W_o's input.
    Matmuls run in the dtype of the output (the autocast dtype, as F.linear does).
    """

    @staticmethod
    def forward(
        ctx,
        y: torch.Tensor,
        v: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        z, coef, inv_norm = _xsa_forward(y, v, eps=eps, scale=scale)
        out = F.linear(z.flatten(-3), weight, bias)
        ctx.save_for_backward(y, v, scale, coef, inv_norm, weight)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, v, scale, coef, inv_norm, weight = ctx.saved_tensors
        _, _, _, need_scale, need_weight, need_bias = ctx.needs_input_grad
        grad_weight = grad_bias = None
        if need_weight:  # first, so that z is freed before the fp32 temporaries below are made
            z = _subtract(y, _upcast(v), coef=coef, scale=scale)  # rounded as the forward's z was
            z = z.flatten(-3).reshape(-1, weight.shape[1]).to(grad_out.dtype)
            grad_weight = (grad_out.reshape(-1, weight.shape[0]).T @ z).to(weight.dtype)
            del z
        if ctx.has_bias and need_bias:
            grad_bias = grad_out.reshape(-1, weight.shape[0]).sum(0).to(weight.dtype)  # bias shares W's dtype
        grad_z = (grad_out @ weight.to(grad_out.dtype)).view(y.shape)
        grad_y, grad_v, grad_scale = _xsa_backward(
            grad_z, y=y, v=v, scale=scale, coef=coef, inv_norm=inv_norm, scale_needs_grad=need_scale
        )
        return grad_y, grad_v, None, grad_scale, grad_weight, grad_bias


def exclusive_projection(
    y: torch.Tensor, v: torch.Tensor, eps: float = 1e-6, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """XSA: remove from each attention output y_i its component along the token's own value v_i.

    z_i = y_i - (y_i . v_i) v_i / ||v_i||^2, per head, on (..., T, D) tensors: xsa_reference, with less memory kept
    for the backward. v broadcasts against y (grouped-query attention passes v as (B, H_kv, 1, T, D) against y as
    (B, H_kv, G, T, D): no copies of v). eps is added to ||v_i||^2 so a zero value vector leaves y_i unchanged
    instead of producing NaN. `scale` (broadcastable to (..., 1, 1)) multiplies the subtracted part: the gated
    variant passes tanh(alpha) per head.
    """
    return ExclusiveProjection.apply(y, v, eps, scale)


def exclusive_layers(layers: Any, n_layer: int) -> tuple[int, ...]:
    """XSA's `layers` option as 0-based indices: all, the last N, or these; at least one (XSA on none is SA)."""
    if layers == "all":
        return tuple(range(n_layer))
    if isinstance(layers, int) and not isinstance(layers, bool):
        if not 0 <= layers <= n_layer:
            raise ValueError(f"layers={layers}: the last N layers needs 0 <= N <= model.n_layer={n_layer}")
        chosen = tuple(range(n_layer - layers, n_layer))
    elif isinstance(layers, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        if any(not 0 <= i < n_layer for i in layers):
            raise ValueError(
                f"layers={list(layers)}: each layer is a 0-based index below model.n_layer={n_layer}, e.g. "
                f"[0,{n_layer - 1}]"
            )
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers={list(layers)} names a layer twice: list each layer once")
        chosen = tuple(sorted(layers))
    else:
        raise ValueError(
            f"layers={layers!r} must be all, a number of last layers, or a list of 0-based layer indices, e.g. [0,1]"
        )
    if not chosen:
        raise ValueError(
            f"layers={list(layers) if isinstance(layers, tuple) else layers} puts XSA on no layer, "
            "which is plain SA: use attention=sa"
        )
    return chosen


class ExclusiveSelfAttention(CausalSelfAttention):
    """XSA: the head outputs are z = y - (y . v) v / ||v||^2 per head (v: the token's own value), on `layers` (all,
    the last N, or these 0-based indices; the others are SA). gate=tanh subtracts tanh(alpha_h) x the projection,
    alpha per head zero-initialised, so training starts exactly as SA. eps is added to ||v||^2 (computed in fp32)."""

    exclusive_memory = True

    def __init__(
        self, config: GPTConfig, layer: int = 0, eps: float = 1e-6, layers: Any = "all", gate: str = "none"
    ) -> None:
        super().__init__(config, layer)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps):
            raise ValueError(f"eps={eps} must be a finite number")
        if not eps > 0:
            raise ValueError(f"eps={eps} must be > 0")
        if gate not in ("none", "tanh"):
            raise ValueError(f"gate={gate} must be one of none, tanh")
        self.exclusive = layer in exclusive_layers(layers, config.n_layer)
        self.gate = nn.Parameter(torch.zeros(config.n_head)) if self.exclusive and gate == "tanh" else None
        self.eps = float(eps)

    @classmethod
    def settled_options(cls, config: GPTConfig, options: dict[str, Any]) -> dict[str, Any]:
        """layers as the indices it gives (all: every layer), as a config saved before options were classes has them;
        eps at most 1% of ||v||^2 at initialisation."""
        # z = y - (y.v) v / (||v||^2 + eps): eps guards a zero v, and against ||v||^2 it scales the projection by
        # ||v||^2 / (||v||^2 + eps); v's entries start with variance d_model x init_std^2 (LayerNorm'd input).
        initial = config.head_dim * config.d_model * config.init_std**2
        if options["eps"] > initial / 100:
            raise ValueError(
                f"eps={options['eps']:g} must be at most {initial / 100:.3g}, 1% of ||v||^2 at initialisation "
                f"(head_dim x d_model x init_std^2 = {initial:.3g}): a larger eps scales the exclusive projection "
                "down, toward plain SA"
            )
        chosen = exclusive_layers(options["layers"], config.n_layer)
        return {**options, "layers": "all" if len(chosen) == config.n_layer else list(chosen)}

    def _grouped(self, v: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """y as (B, T, H_kv, G, D) against v as (B, T, H_kv, 1, D): each query head projects on its KV group's v
        (only the new tokens' own v is needed, so a KV cache serves XSA as it serves SA); the gate per head."""
        H, H_kv = self.n_head, self.n_kv_head
        y_g, v_g = y.unflatten(2, (H_kv, H // H_kv)), v.transpose(1, 2).unsqueeze(3)
        scale = None if self.gate is None else torch.tanh(self.gate).view(H_kv, H // H_kv, 1)
        return y_g, v_g, scale

    def heads(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        if not self.exclusive:
            return y
        y_g, v_g, scale = self._grouped(v, y)
        return exclusive_projection(y_g, v_g, eps=self.eps, scale=scale).flatten(2, 3)

    def project(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        if not self.exclusive:
            return super().project(x, q, k, v, y)
        # self.proj(self.heads(...).flatten(2)), fused to keep no z for the backward
        y_g, v_g, scale = self._grouped(v, y)
        return ExclusiveOutputProjection.apply(y_g, v_g, self.eps, scale, self.proj.weight, self.proj.bias)
