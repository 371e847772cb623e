"""The XSA step (arXiv 2603.09078, Algorithm 1): remove from each attention output its component along the token's own
value vector. A reference in plain torch, and the step as torch.library custom ops that keep less memory for the
backward.

The ops (`xsa_lm::exclusive`, `xsa_lm::exclusive_output_projection` and their backward `xsa_lm::exclusive_backward`)
are opaque to torch.compile: Inductor calls them as they are and cannot fold XSA's math into its neighbours' kernels
(it used to fold the gradient of v into the kernel that writes the qkv gradient, making that kernel re-read the
gradient, y and v). Each op's body is per-row math over the last dim: the forward reads y and v and writes z and two
fp32 numbers per token and head, (y . v) / n and 1 / n with n = ||v||^2 + eps; the backward reads the gradient of z,
y, v and those numbers and writes the gradients of y, v (and the gate).
On CUDA the bodies are compiled (one generated kernel each, dynamic shapes); on CPU they run eagerly: there an
Inductor body would cost every process seconds of C++ compilation, and the CPU runs (tests, the demo) keep their
numbers. Eager and compiled training run the same ops.

Memory: only v is converted to fp32 for the pass; y and the gradient enter each product as they are (type promotion
computes in fp32). The output projection keeps no z: its backward recomputes z with `xsa_lm::exclusive` (one more
pass over y and v, freed before the backward op's temporaries are made), so an XSA layer keeps 2 numbers per token
and head more than SA, compiled or not. One XSA output projection alone (eager, CPU), its allocator peak in units of
y's bytes (B 2, T 64, 4 heads of 16): bf16 forward 6.25, backward 8.75; fp32 backward 3.6. The plan
(train/memory.py) counts these terms; tests/test_memory_peak.py checks them against the allocator to the byte.
"""

import functools
import hashlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from xsa_lm.model.attention import CausalSelfAttention
from xsa_lm.model.config import GPTConfig

COMPILED_ON = ("cuda",)  # the devices whose op bodies run compiled (see the module docstring)
# torch's compile caches key a graph by its forward: after a change to the ops' backward they would serve the one
# traced from the old code. This file's hash joins the cache key (sdpa.compile_cache_key).
SOURCE_KEY = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


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


# The ops below compute xsa_reference's z with a hand-written backward: tests/test_attention.py checks their forward
# and gradients against xsa_reference (equal to float rounding), with GQA broadcasting, the gate and bf16.


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a . b over the last dim, kept. Not torch.linalg.vecdot: autocast runs that in bf16, whatever its inputs."""
    return (a * b).sum(-1, keepdim=True)


def _row_dtype(v: torch.Tensor) -> torch.dtype:
    """At least fp32 (bf16 loses the orthogonality); fp64 stays fp64, so gradcheck can check the backward."""
    return torch.promote_types(v.dtype, torch.float32)


def _subtract(y: torch.Tensor, v32: torch.Tensor, coef: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """z = y - scale * coef * v, computed in v32's dtype and returned in y's."""
    return torch.addcmul(y, coef if scale is None else coef * scale, v32, value=-1.0).to(y.dtype)


def _forward_rows(
    y: torch.Tensor, v: torch.Tensor, scale: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z, and for the backward (y . v) / n and 1 / n. Only v is converted: y enters each product beside it as it
    is, type promotion computing in v's dtype (exactly: a product of two bf16 numbers fits in fp32)."""
    v32 = v.to(_row_dtype(v))
    inv_norm = 1.0 / (_dot(v32, v32) + eps)
    coef = _dot(y, v32) * inv_norm
    return _subtract(y, v32, coef, scale).contiguous(), coef.contiguous(), inv_norm.contiguous()


def _backward_rows(
    grad: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor,
    scale: torch.Tensor | None,
    coef: torch.Tensor,
    inv_norm: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of y, v and the gate (empty without one) given g = dL/dz. Eagerly each full-size fp32
    temporary is consumed before the next is made."""
    v32 = v.to(_row_dtype(v))
    g_dot_v = _dot(grad, v32)
    k = g_dot_v * inv_norm if scale is None else g_dot_v * inv_norm * scale  # s (g . v) / n
    c = coef if scale is None else coef * scale
    # dz/dv: -s c g - k y + 2 k c v (the last from differentiating 1 / ||v||^2), in place on the first term
    grad_v = (grad * -c).addcmul_(k, y, value=-1.0).addcmul_(k * coef, v32, value=2.0)
    grad_v = grad_v.sum_to_size(v.shape).to(v.dtype).contiguous()  # GQA: summed over the query heads sharing v
    grad_y = torch.addcmul(grad, k, v32, value=-1.0).to(y.dtype).contiguous()  # g - k v
    grad_scale = (
        y.new_empty(0) if scale is None else (-(g_dot_v * coef)).sum_to_size(scale.shape).to(scale.dtype).contiguous()
    )
    return grad_y, grad_v, grad_scale


@functools.cache
def _compiled(rows: Callable) -> Callable:
    return torch.compile(rows, dynamic=True, fullgraph=True)


def _body(rows: Callable, device: torch.device) -> Callable:
    return _compiled(rows) if device.type in COMPILED_ON else rows


@torch.library.custom_op("xsa_lm::exclusive", mutates_args=())
def _exclusive(
    y: torch.Tensor, v: torch.Tensor, scale: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _body(_forward_rows, y.device)(y, v, scale, eps)


@torch.library.custom_op("xsa_lm::exclusive_backward", mutates_args=())
def _exclusive_backward(
    grad: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor,
    scale: torch.Tensor | None,
    coef: torch.Tensor,
    inv_norm: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _body(_backward_rows, y.device)(grad, y, v, scale, coef, inv_norm)


@torch.library.custom_op("xsa_lm::exclusive_output_projection", mutates_args=())
def _exclusive_output_projection(
    y: torch.Tensor,
    v: torch.Tensor,
    scale: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    z, coef, inv_norm = _body(_forward_rows, y.device)(y, v, scale, eps)
    out = F.linear(z.flatten(-3).to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return out, coef, inv_norm


def _fake_rows(y: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two numbers per token and head, as _forward_rows makes them."""
    row = _row_dtype(v)
    return y.new_empty((*y.shape[:-1], 1), dtype=torch.promote_types(y.dtype, row)), v.new_empty(
        (*v.shape[:-1], 1), dtype=row
    )


@_exclusive.register_fake
def _(y, v, scale, eps):
    return (y.new_empty(y.shape), *_fake_rows(y, v))


@_exclusive_backward.register_fake
def _(grad, y, v, scale, coef, inv_norm):
    grad_scale = y.new_empty(0) if scale is None else scale.new_empty(scale.shape)
    return y.new_empty(y.shape), v.new_empty(v.shape), grad_scale


@_exclusive_output_projection.register_fake
def _(y, v, scale, weight, bias, eps, dtype):
    return (y.new_empty((*y.shape[:-3], weight.shape[0]), dtype=dtype), *_fake_rows(y, v))


def _keep(ctx, output: tuple, y, v, scale, eps: float, weight: torch.Tensor | None = None) -> None:
    """Saved: y and v as they came in (bf16 stays bf16; SDPA keeps both for its own backward anyway), the gate, the
    two numbers per token and head, and W_o where there is one (its fp32 master under autocast, as given)."""
    _, coef, inv_norm = output
    ctx.mark_non_differentiable(coef, inv_norm)
    ctx.set_materialize_grads(False)  # no zero gradients made for them
    ctx.eps = eps
    ctx.save_for_backward(y, v, scale, coef, inv_norm, weight)


def _keep_for_exclusive(ctx, inputs: tuple, output: tuple) -> None:
    y, v, scale, eps = inputs
    _keep(ctx, output, y, v, scale, eps)


def _keep_for_output_projection(ctx, inputs: tuple, output: tuple) -> None:
    y, v, scale, weight, bias, eps, _ = inputs
    ctx.has_bias = bias is not None
    _keep(ctx, output, y, v, scale, eps, weight)


def _exclusive_grads(ctx, grad: torch.Tensor | None, *_: Any) -> tuple[torch.Tensor | None, ...]:
    if grad is None:  # z unused
        return None, None, None, None
    y, v, scale, coef, inv_norm, _ = ctx.saved_tensors
    grad_y, grad_v, grad_scale = _exclusive_backward(grad, y, v, scale, coef, inv_norm)
    return grad_y, grad_v, None if scale is None else grad_scale, None


def _output_projection_grads(ctx, grad_out: torch.Tensor | None, *_: Any) -> tuple[torch.Tensor | None, ...]:
    if grad_out is None:  # the output unused
        return (None,) * 7
    y, v, scale, coef, inv_norm, weight = ctx.saved_tensors
    flat = grad_out.reshape(-1, weight.shape[0])
    # W_o's weight gradient first, so that the recomputed z is freed before the backward's temporaries are made
    z = _exclusive(y, v, scale, ctx.eps)[0].reshape(-1, weight.shape[1]).to(grad_out.dtype)
    grad_weight = (flat.T @ z).to(weight.dtype)
    del z
    grad_bias = flat.sum(0).to(weight.dtype) if ctx.has_bias else None  # bias shares W's dtype
    grad_z = (grad_out @ weight.to(grad_out.dtype)).view(y.shape)
    grad_y, grad_v, grad_scale = _exclusive_backward(grad_z, y, v, scale, coef, inv_norm)
    return grad_y, grad_v, None if scale is None else grad_scale, grad_weight, grad_bias, None, None


_exclusive.register_autograd(_exclusive_grads, setup_context=_keep_for_exclusive)
_exclusive_output_projection.register_autograd(_output_projection_grads, setup_context=_keep_for_output_projection)


@register_flop_formula(torch.ops.xsa_lm.exclusive_output_projection)
def _(y_shape, v_shape, scale_shape, weight_shape, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """W_o's matmul inside the op, which FlopCounterMode (MFU's count in the tests) cannot see into."""
    return 2 * math.prod(y_shape[:-3]) * weight_shape[0] * weight_shape[1]


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
    return _exclusive(y, v, scale, float(eps))[0]


def exclusive_output_projection(
    y: torch.Tensor,
    v: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(exclusive_projection(y, v, eps, scale).flatten(-3), weight, bias), keeping no z for the backward.

    y is (..., H_kv, G, D) and v (..., H_kv, 1, D); the last three dims are flattened into W_o's input. The matmul
    runs in autocast's dtype where autocast is on (as F.linear would), else in W_o's.
    """
    device = y.device.type
    autocast = device != "meta" and torch.is_autocast_enabled(device)  # meta has no autocast (it raises)
    dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
    return _exclusive_output_projection(y, v, scale, weight, bias, float(eps), dtype)[0]


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
        return exclusive_output_projection(y_g, v_g, self.proj.weight, self.proj.bias, eps=self.eps, scale=scale)
