"""XSA math and the SA path against a straightforward reference; the fused XSA op against xsa_reference."""

import math
from collections.abc import Callable
from typing import cast

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import GATED_GQA
from xsa_lm.model import (
    GPT,
    CausalSelfAttention,
    ExclusiveSelfAttention,
    GPTConfig,
    exclusive_projection,
    xsa_reference,
)
from xsa_lm.model.attention import apply_rope, attention_layer, rope_tables
from xsa_lm.model.xsa import exclusive_output_projection


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a, b, dim=-1)


def test_reference_and_fused_op_equal_the_formula_vector_by_vector():
    torch.manual_seed(0)
    y, v = torch.randn(2, 3, 5, 8, dtype=torch.float64), torch.randn(2, 3, 5, 8, dtype=torch.float64)
    expected = torch.empty_like(y)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in y.shape[:3])).tolist():
        yi, vi = y[tuple(idx)], v[tuple(idx)]
        expected[tuple(idx)] = yi - (yi @ vi) * vi / (vi @ vi)
    for z in (xsa_reference(y, v, eps=0.0), exclusive_projection(y, v, eps=0.0)):
        assert z.dtype == y.dtype
        torch.testing.assert_close(z, expected, rtol=0, atol=1e-12)  # fp64 inputs are computed in fp64


def test_output_is_orthogonal_to_own_value_per_head():
    torch.manual_seed(1)
    y, v = torch.randn(4, 6, 32, 16), torch.randn(4, 6, 32, 16)
    z = exclusive_projection(y, v)
    assert cosine(z, v).abs().max() < 1e-5
    assert not torch.allclose(z, y)  # it did remove something


def test_zero_value_vector_is_guarded():
    y, v = torch.randn(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)
    z = exclusive_projection(y, v)
    assert torch.isfinite(z).all()
    torch.testing.assert_close(z, y)


def test_bf16_inputs_stay_bf16_and_orthogonal():
    torch.manual_seed(2)
    y, v = torch.randn(2, 2, 16, 64).bfloat16(), torch.randn(2, 2, 16, 64).bfloat16()
    z = exclusive_projection(y, v)
    assert z.dtype == torch.bfloat16
    assert cosine(z.float(), v.float()).abs().max() < 2e-2  # bf16 rounding of z only


def reference_attention(attn: CausalSelfAttention, x: torch.Tensor, exclusive: bool) -> tuple[torch.Tensor, ...]:
    """Loop-free but explicit causal multi-head attention with RoPE, the softmax written out."""
    B, T, _ = x.shape
    H, D = attn.n_head, attn.head_dim
    q, k, v = attn.qkv(x).split(H * D, dim=-1)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
    cos, sin = rope_tables(T, D)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    y = scores.softmax(-1) @ v
    if exclusive:
        y = xsa_reference(y, v, eps=cast(ExclusiveSelfAttention, attn).eps)
    out = attn.proj(y.transpose(1, 2).reshape(B, T, H * D))
    return out, y, v


@pytest.mark.parametrize("attention", ["sa", "xsa"])
def test_attention_matches_reference(attention: str):
    torch.manual_seed(3)
    config = GPTConfig(d_model=48, n_head=3, head_dim=24, block_size=16, attention=attention)  # inner 72 != d_model
    attn = attention_layer(config, 0).double()
    x = torch.randn(2, 16, 48, dtype=torch.float64)
    cos, sin = (t.double() for t in rope_tables(16, 24))
    expected, _, _ = reference_attention(attn, x, exclusive=attention == "xsa")
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-6, atol=1e-6)


def test_xsa_first_position_output_is_zero_in_every_head():
    """Causality gives a_00 = 1, so y_0 = v_0 and z_0 = 0 exactly (before the output projection)."""
    torch.manual_seed(4)
    config = GPTConfig(d_model=32, n_head=4, head_dim=8, block_size=8, attention="xsa")
    attn = attention_layer(config, 0).double()
    _, y, v = reference_attention(attn, torch.randn(3, 8, 32, dtype=torch.float64), exclusive=False)
    z = exclusive_projection(y, v, eps=0.0)
    assert z[:, :, 0].abs().max() < 1e-6
    assert z[:, :, 1:].abs().max() > 1e-3
    # and the module itself: its output at position 0 is the output projection of zero (no bias)
    x = torch.randn(3, 8, 32, dtype=torch.float64)
    cos, sin = (t.double() for t in rope_tables(8, 8))
    assert attn(x, cos, sin)[:, 0].abs().max() < 1e-6


def test_rope_keeps_norms_and_is_relative():
    torch.manual_seed(5)
    cos, sin = rope_tables(32, 16)
    q, k = torch.randn(1, 1, 1, 16).expand(1, 1, 32, 16), torch.randn(1, 1, 1, 16).expand(1, 1, 32, 16)
    rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dots = (rq[0, 0, 3:] * rk[0, 0, :-3]).sum(-1)  # same offset (3) at every position -> same dot product
    torch.testing.assert_close(dots, dots[0].expand_as(dots), rtol=1e-4, atol=1e-4)


def gqa_inputs(dtype: torch.dtype, seed: int = 6, tokens: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y as (B, H_kv, G, T, D) against a broadcast v (B, H_kv, 1, T, D), and a per-head gate, as the model passes."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(2, 2, 3, tokens, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(2, 2, 1, tokens, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    scale = torch.tanh(torch.randn(2, 3, 1, 1, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    return y, v, scale


def test_hand_written_backward_passes_gradcheck():
    y, v, scale = gqa_inputs(torch.float64, tokens=2)  # few tokens: each input number costs two op calls
    assert torch.autograd.gradcheck(lambda a, b, s: exclusive_projection(a, b, eps=1e-6, scale=s), (y, v, scale))
    assert torch.autograd.gradcheck(lambda a, b: exclusive_projection(a, b, eps=1e-6), (y, v))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("gated", [False, True])
def test_forward_and_backward_equal_the_reference(dtype: torch.dtype, tol: float, gated: bool):
    """The fused op against xsa_reference left to autograd in fp64, with GQA broadcasting, the gate and bf16."""
    y, v, scale = gqa_inputs(dtype)
    scale = scale if gated else None
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    z = exclusive_projection(y, v, eps=1e-6, scale=scale)
    assert z.dtype == dtype
    z.backward(grad.to(dtype))
    inputs = [t.detach().double().requires_grad_() for t in (y, v, *([scale] if gated else []))]
    expected = xsa_reference(inputs[0], inputs[1], eps=1e-6, scale=inputs[2] if gated else None)
    expected.backward(grad)
    # bf16: the inputs are rounded alike, then z and the gradients are rounded once more on the way out
    torch.testing.assert_close(z.double(), expected, rtol=tol, atol=tol)
    for ours, ref in zip((y, v, *([scale] if gated else [])), inputs, strict=True):
        assert ours.grad.dtype == dtype and ours.grad.shape == ours.shape
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=tol, atol=tol * ref.grad.abs().max().item())


BF16_UNIT = 2.0**-8  # bf16 keeps 8 significant bits: rounding to nearest moves x by at most 2^-8 |x|


def bf16_inputs(seed: int, *, kv_heads: int, group: int, gated: bool) -> list[torch.Tensor]:
    """bf16 y, v (and the gate) as the model passes them, (B, T, H_kv, G, D) against (B, T, H_kv, 1, D): y partly
    along v (z is then a small remainder), and v near zero at some tokens: ||v||^2 far below eps, near it, and 0."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(2, 16, kv_heads, 1, 64, generator=g)
    v[:, 3], v[:, 5], v[:, 7] = v[:, 3] * 1e-5, v[:, 5] * 1e-4, 0.0
    y = torch.randn(2, 16, kv_heads, group, 64, generator=g) + 2 * v
    inputs = [y, v] + ([torch.tanh(torch.randn(kv_heads, group, 1, generator=g))] if gated else [])
    return [t.bfloat16().requires_grad_() for t in inputs]


def in_fp64(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same (bf16-rounded) values in fp64: what the reference computes from."""
    return [t.detach().double().requires_grad_() for t in tensors]


def relative_error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return ((ours.double() - exact).norm() / exact.norm()).item()


BF16_CASES = [(2, 1, False), (2, 1, True), (1, 3, False), (1, 3, True)]  # (H_kv, G, gated): MHA and GQA


@pytest.mark.parametrize(("kv_heads", "group", "gated"), BF16_CASES)
def test_bf16_gradients_are_the_fp64_gradients_rounded_once(kv_heads: int, group: int, gated: bool):
    """bf16 y, v, gate and dL/dz: each gradient is computed in fp32 and rounded to bf16 once, so it differs from the
    fp64 gradient of the same inputs by at most 2^-8 of each element, hence of its norm. The fp32 arithmetic before
    (~2^-24 per operation, sums of at most 64 or B T terms) gets 1/16 of that as room. Measured over 30 seeds per
    case: at most 0.83 x 2^-8 (the gate's, one number per head). A backward computed in bf16 reaches 5.6 x 2^-8 (4 of
    these 12 cases fail), one without the 2 k c v term 28 x 2^-8 (all fail)."""
    for seed in range(3):
        inputs = bf16_inputs(seed, kv_heads=kv_heads, group=group, gated=gated)
        grad = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(100 + seed)).bfloat16()
        exclusive_projection(*inputs[:2], eps=1e-6, scale=inputs[2] if gated else None).backward(grad)
        exact = in_fp64(inputs)
        xsa_reference(*exact[:2], eps=1e-6, scale=exact[2] if gated else None).backward(grad.double())
        for name, ours, reference in zip("yvs", inputs, exact, strict=False):
            assert ours.grad.dtype == torch.bfloat16
            assert relative_error(ours.grad, reference.grad) <= (1 + 1 / 16) * BF16_UNIT, (seed, name)


@pytest.mark.parametrize(("kv_heads", "group", "gated"), BF16_CASES)
def test_bf16_output_projection_gradients_are_within_two_roundings_of_fp64(kv_heads: int, group: int, gated: bool):
    """bf16 y, v, gate and W_o (FSDP2's bf16 parameters, no autocast), against W_o(xsa_reference) in fp64 from the
    same values. Two bf16 roundings on each path, each at most 2^-8 of every element: dL/dz = dL/dout @ W_o, then the
    gradient itself (for W_o: z, then its gradient; for out: z, then out). The maps between them (the projection
    I - s v v^T / n with |s| <= 1, sums over tokens) keep the relative error of these inputs near one rounding's:
    c = 2 (measured at most 1.16, grad_v's, over 30 seeds per case; without the 2 k c v term 11 of these 12 cases
    fail). The gate's gradient is a sum over tokens of -(g . v) c that cancels, so it is bounded against the sum of
    the magnitudes: dL/dz's rounding moves each g . v by at most 2^-8 |g| . |v| (measured: 0.07 of that bound)."""
    for seed in range(3):
        inputs = bf16_inputs(seed, kv_heads=kv_heads, group=group, gated=gated)
        g = torch.Generator().manual_seed(200 + seed)
        weight = (torch.randn(48, kv_heads * group * 64, generator=g) / 16).bfloat16().requires_grad_()
        grad_out = torch.randn(2, 16, 48, generator=g).bfloat16()
        y, v, scale = inputs[0], inputs[1], inputs[2] if gated else None
        out = exclusive_output_projection(y, v, weight, None, eps=1e-6, scale=scale)
        out.backward(grad_out)
        y64, v64, *gate64 = in_fp64(inputs)
        weight64 = in_fp64([weight])[0]
        scale64 = gate64[0] if gated else None
        out64 = F.linear(xsa_reference(y64, v64, eps=1e-6, scale=scale64).flatten(-3), weight64)
        out64.backward(grad_out.double())
        assert relative_error(out, out64) <= 2 * BF16_UNIT
        for name, ours, reference in (("y", y, y64), ("v", v, v64), ("W_o", weight, weight64)):
            assert ours.grad.dtype == torch.bfloat16
            assert relative_error(ours.grad, reference.grad) <= 2 * BF16_UNIT, (seed, name)
        if gated:
            grad_z = (grad_out.double() @ weight64.detach()).view(y.shape)
            coef = (y64 * v64).sum(-1, keepdim=True) / ((v64 * v64).sum(-1, keepdim=True) + 1e-6)
            magnitude = ((grad_z.abs() * v64.abs()).sum(-1, keepdim=True) * coef.abs()).sum_to_size(scale.shape)
            error = (scale.grad.double() - scale64.grad).abs()
            assert (error <= 2 * BF16_UNIT * (scale64.grad.abs() + magnitude)).all(), seed


def test_only_the_inputs_and_two_numbers_per_token_are_saved_for_backward():
    """No fp32 copies of y or v: the backward works from them as they came in, plus (y . v) / n and 1 / n."""
    y, v, scale = gqa_inputs(torch.bfloat16)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        exclusive_projection(y, v, eps=1e-6, scale=scale)
    inputs = {y.data_ptr(), v.data_ptr(), scale.data_ptr()}
    assert inputs <= {t.data_ptr() for t in saved} and all(t.dtype == torch.bfloat16 for t in saved[:3])
    extra = [t for t in saved if t.data_ptr() not in inputs]
    assert sum(t.numel() for t in extra) <= 2 * y.numel() // y.shape[-1]  # per token and head: coef and 1 / n


def output_projection_inputs(dtype: torch.dtype, tokens: int = 7) -> tuple[torch.Tensor, ...]:
    y, v, scale = gqa_inputs(dtype, tokens=tokens)
    g = torch.Generator().manual_seed(8)
    weight = torch.randn(5, 2 * 3 * 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    bias = torch.randn(5, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    # (B, T, H_kv, G, D) as the attention module passes them: move T in front of the heads
    y, v = (t.detach().permute(0, 3, 1, 2, 4).contiguous().requires_grad_() for t in (y, v))
    return y, v, scale.detach().view(2, 3, 1).requires_grad_(), weight, bias


def test_fused_output_projection_passes_gradcheck():
    y, v, scale, weight, bias = output_projection_inputs(torch.float64, tokens=2)
    fused = lambda y, v, s, w, b: exclusive_output_projection(y, v, w, b, eps=1e-6, scale=s)
    assert torch.autograd.gradcheck(fused, (y, v, scale, weight, bias))
    no_gate_no_bias = lambda y, v, w: exclusive_output_projection(y, v, w, None, eps=1e-6, scale=None)
    assert torch.autograd.gradcheck(no_gate_no_bias, (y, v, weight))


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_output_projection_equals_projecting_the_reference(autocast: bool):
    """Forward and every gradient equal W_o(xsa_reference(y, v)) left to autograd, also under bf16 autocast."""
    results = []
    for fused in (True, False):
        y, v, scale, weight, bias = output_projection_inputs(torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y_in, v_in = (y.bfloat16(), v.bfloat16()) if autocast else (y, v)  # SDPA's outputs are bf16 under autocast
            if fused:
                out = exclusive_output_projection(y_in, v_in, weight, bias, eps=1e-6, scale=scale)
            else:
                out = F.linear(xsa_reference(y_in, v_in, eps=1e-6, scale=scale).flatten(-3), weight, bias)
        out.backward(torch.ones_like(out))
        results.append([out, *(t.grad for t in (y, v, scale, weight, bias))])
    tol = 2e-2 if autocast else 1e-5
    for ours, ref in zip(*results, strict=True):
        assert ours.dtype == ref.dtype
        torch.testing.assert_close(ours, ref, rtol=tol, atol=tol * ref.abs().max().item())


def saved_bytes(attn: CausalSelfAttention, x: torch.Tensor) -> int:
    """Bytes of the activations a layer keeps for its backward (each storage once, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in attn.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cos, sin = rope_tables(x.size(1), attn.head_dim)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        attn(x, cos, sin)
    return sum(saved.values())


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_an_xsa_layer_keeps_only_two_numbers_per_token_and_head_more_than_sa(n_kv_head: int):
    x = torch.randn(2, 16, 64)
    sizes = {}
    for attention in ("sa", "xsa"):
        config = GPTConfig(d_model=64, n_head=4, head_dim=16, block_size=16, attention=attention, n_kv_head=n_kv_head)
        sizes[attention] = saved_bytes(attention_layer(config, 0), x)
    assert 0 < sizes["xsa"] - sizes["sa"] <= 2 * 2 * 16 * 4 * 4  # coef and 1 / n: B x T x heads fp32 numbers each


def autocast_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 y and v as SDPA returns them under autocast, y largely along v (so the projection has much to remove)."""
    g = torch.Generator().manual_seed(11)
    v = torch.randn(2, 64, 4, 1, 64, generator=g).bfloat16()
    y = (torch.randn(2, 64, 4, 1, 64, generator=g) + 3 * v.float()).bfloat16()
    return y.requires_grad_(), v.requires_grad_()


def errors_under_autocast(op: Callable) -> tuple[float, float, float]:
    """max |cos(z, v)|, and the y and v gradients' largest error against fp64 xsa_reference, under CPU bf16 autocast."""
    y, v = autocast_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = op(y, v)
    grad = torch.randn(z.shape, generator=torch.Generator().manual_seed(12)).bfloat16()
    z.backward(grad)
    y64, v64 = (t.detach().double().requires_grad_() for t in (y, v))
    xsa_reference(y64, v64, eps=1e-6).backward(grad.double())
    cos = cosine(z.double(), v.detach().double()).abs().max().item()
    return cos, (y.grad.double() - y64.grad).abs().max().item(), (v.grad.double() - v64.grad).abs().max().item()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fused_op_keeps_fp32_precision_under_autocast(compiled: bool):
    """Autocast runs some reductions (torch.linalg.vecdot) in bf16 whatever their inputs: the fused op's (y . v) / n
    must not be among them. Its orthogonality and gradients must be as good as xsa_reference's, which computes in
    fp32 by hand (before the fix: |cos(z, v)| 3e-2 against 7e-4)."""
    fused = lambda y, v: exclusive_projection(y, v, eps=1e-6)
    reference = lambda y, v: xsa_reference(y, v, eps=1e-6)
    if compiled:
        torch._dynamo.reset()
        fused = torch.compile(fused, fullgraph=True)
    cos, grad_y_error, grad_v_error = errors_under_autocast(fused)
    ref_cos, ref_grad_y_error, ref_grad_v_error = errors_under_autocast(reference)
    assert ref_cos < 2e-3  # bf16 rounding of z only
    assert cos <= 2 * ref_cos
    assert grad_y_error <= 2 * ref_grad_y_error and grad_v_error <= 2 * ref_grad_v_error


def test_output_projection_saves_fp32_coefficients_under_autocast():
    """What the fused output projection keeps for its backward: y and v as they came (bf16) and fp32 coefficients."""
    y, v = autocast_inputs()
    weight = torch.randn(8, 4 * 64, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            exclusive_output_projection(y, v, weight, None, eps=1e-6, scale=None)
    coefficients = [t for t in saved if t.shape == y.shape[:-1] + (1,)]
    assert len(coefficients) == 2 and all(t.dtype == torch.float32 for t in coefficients)


def test_xsa_ops_run_on_the_meta_device_under_autocast():
    """Shape-only runs (meta tensors, as a memory rehearsal makes them) go through the ops' fake kernels: a training
    step's shapes and dtypes, autocast on (which meta tensors do not take)."""
    config = GPTConfig(**GATED_GQA)
    with torch.device("meta"):
        model = GPT(config)
        idx = torch.randint(0, 64, (2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, idx)[1]
        loss.backward()
    attn = model.blocks[0].attn
    assert loss.is_meta and attn.proj.weight.grad.shape == attn.proj.weight.shape and attn.gate.grad.shape == (4,)
