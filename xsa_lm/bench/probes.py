"""What actually runs on the device: the SDPA kernel attention dispatches to (torch.profiler's names), and whether
XSA's output stays orthogonal to each token's own value under bf16 autocast, fused op and paper formula alike."""

from collections.abc import Callable
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from xsa_lm.model import exclusive_projection, xsa_reference

# The aten operator scaled_dot_product_attention dispatched to -> its backend.
SDPA_BACKENDS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "aten::_scaled_dot_product_attention_math": "math",
}
KERNEL_WORDS = ("flash", "fmha", "attention", "attn", "sdpa", "cudnn")  # device kernels of SDPA's backends
MAX_NAME = 160  # templated kernel names run to kilobytes
MAX_NAMES = 12
KEPT_NORM = 0.01  # |z_i| below this share of |y_i|: too little left of y_i to have a direction


class KernelsRun(TypedDict):
    backends: list[str]  # SDPA's backends, from the aten operators
    operators: list[str]
    kernels: list[str]  # the device kernels' names, the first MAX_NAMES, each cut to MAX_NAME characters
    kernel_count: int


class Orthogonality(TypedDict):
    shape: list[int]  # batch, heads, context, head_dim
    dtype: str
    max_abs_cos: dict[str, float]  # per variant: fused, fused_compiled, reference, reference_fp64, before_xsa
    tokens_left_out: int
    max_abs_difference: dict[str, float]


def profiled_names(fn: Callable[[], object]) -> tuple[set[str], set[str]]:
    """The names of the operators (host) and of the kernels (device) that run in fn()."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    operators: set[str] = set()
    kernels: set[str] = set()
    for event in prof.events():
        on_host = event.device_type == torch.autograd.DeviceType.CPU
        (operators if on_host else kernels).add(event.name)
    return operators, kernels


def sdpa_kernels(fn: Callable[[], object]) -> KernelsRun:
    """Which SDPA backend fn() runs (forward and backward), from the aten operators and device kernels profiled."""
    operators, kernels = profiled_names(fn)
    backends = sorted({backend for op, backend in SDPA_BACKENDS.items() if op in operators})
    attention = sorted(k for k in kernels if any(word in k.lower() for word in KERNEL_WORDS))
    return {
        "backends": backends,
        "operators": sorted(op for op in operators if op in SDPA_BACKENDS or "scaled_dot_product" in op),
        "kernels": [name[:MAX_NAME] for name in attention[:MAX_NAMES]],
        "kernel_count": len(attention),
    }


def max_abs_cos(z: torch.Tensor, v: torch.Tensor, kept: torch.Tensor) -> float:
    """The largest |cos(z_i, v_i)| over the kept tokens and heads, in fp64 from the given (rounded) values."""
    z64, v64 = z.double(), v.double()
    cos = (z64 * v64).sum(-1) / (z64.norm(dim=-1) * v64.norm(dim=-1)).clamp_min(1e-30)
    return cos[kept].abs().max().item()


def xsa_orthogonality(
    device: torch.device, *, heads: int, head_dim: int, context: int, batch: int = 2, seed: int = 0
) -> Orthogonality:
    """max |cos(z, v)| of XSA's fused op (eager and compiled) and of xsa_reference, on y and v as the model makes
    them under bf16 autocast: v from a linear layer, y from causal SDPA. The exact reference shows the floor that bf16
    rounding of z sits above (in fp64); before XSA, |cos(y, v)| for scale."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = heads * head_dim
    x = torch.randn(batch, context, width, generator=g).to(device)
    weight = (torch.randn(3 * width, width, generator=g) / width**0.5).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16), torch.no_grad():
        qkv = F.linear(x, weight).view(batch, context, 3 * heads, head_dim).transpose(1, 2)
        q, k, v = qkv.split(heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fused = exclusive_projection(y, v)
        reference = xsa_reference(y, v)
        compiled = torch.compile(exclusive_projection, dynamic=False)(y, v)
    exact = xsa_reference(y.double(), v.double())
    # Tokens whose y_i is (nearly) parallel to v_i are left out: there z_i is (nearly) zero and its direction is
    # rounding noise (the first token attends only to itself: y_0 = v_0).
    kept = exact.norm(dim=-1) > KEPT_NORM * y.double().norm(dim=-1)
    return {
        "shape": [batch, heads, context, head_dim],
        "dtype": str(y.dtype).removeprefix("torch."),
        "max_abs_cos": {
            "fused": max_abs_cos(fused, v, kept),
            "fused_compiled": max_abs_cos(compiled, v, kept),
            "reference": max_abs_cos(reference, v, kept),
            "reference_fp64": max_abs_cos(exact, v, kept),
            "before_xsa": max_abs_cos(y, v, kept),
        },
        "tokens_left_out": int((~kept).sum()),
        "max_abs_difference": {
            "fused_vs_reference": (fused.double() - reference.double()).abs().max().item(),
            "fused_vs_fp64": (fused.double() - exact).abs().max().item(),
        },
    }


def orthogonality_holds(result: Orthogonality, slack: float = 2.0, floor: float = 1e-3) -> bool:
    """The fused op (eager and compiled) is as orthogonal as the paper formula in the same dtype: within `slack`x
    its max |cos|, or below `floor` outright."""
    cos = result["max_abs_cos"]
    bound = max(slack * cos["reference"], floor)
    return cos["fused"] <= bound and cos["fused_compiled"] <= bound
