"""Which kernel runs attention's SDPA: the order a run asks for (`sdpa_backends`), applied as torch's priority order,
and the kernel torch then picks for a given shape.

torch tries the enabled kernels in its priority order and runs the first that takes the inputs. On CUDA its own order
is flash, efficient, math, cuDNN; cuDNN is reported the fastest for Hopper training shapes, so `auto` puts it first
where the device has it. On CPU torch has two kernels, flash-attention for CPU and math, and runs flash whenever it is
enabled: there a list decides which of the two may run, not their order.
"""

import contextlib
import inspect
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from xsa_lm.errors import UserError
from xsa_lm.model import xsa

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
CUDA_ORDER = ("cudnn", "flash", "efficient", "math")
CPU_KERNELS = ("flash", "math")  # flash-attention for CPU and the math fallback: torch has no other CPU kernel
# The backward node each fused kernel leaves in the autograd graph; math leaves plain ops (matmuls and a softmax).
KERNEL_NODES = {
    "ScaledDotProductCudnnAttentionBackward0": "cudnn",
    "ScaledDotProductFlashAttentionBackward0": "flash",
    "ScaledDotProductFlashAttentionForCpuBackward0": "flash",
    "ScaledDotProductEfficientAttentionBackward0": "efficient",
}
CUDNN_MIN_CAPABILITY = (8, 0)  # torch's cuDNN attention runs on sm80 (Ampere) and newer

# The one place that depends on the torch version: set_priority makes the list's order torch's (torch 2.11 and 2.13
# have it); without it the listed kernels are enabled and torch keeps its own order among them.
_HAS_SET_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def cudnn_attention_supported(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.backends.cudnn.is_available()
        and torch.cuda.get_device_capability(device) >= CUDNN_MIN_CAPABILITY
    )


def kernels_on(device: torch.device) -> tuple[str, ...]:
    """The kernels torch has for this device, in `auto`'s order."""
    if device.type != "cuda":
        return CPU_KERNELS
    return CUDA_ORDER if cudnn_attention_supported(device) else CUDA_ORDER[1:]


def resolve(value: str | Sequence[str], device: torch.device) -> list[str]:
    """`auto` or a list of names -> the kernels SDPA may run on this device, most preferred first. Names the device
    lacks are left out (cudnn on CPU); a list of none it has is refused."""
    problem = config_problem(value)
    if problem:
        raise UserError(f"sdpa_backends={value} {problem}")
    names = [value] if isinstance(value, str) else value  # one name: that kernel alone
    wanted = CUDA_ORDER if value == "auto" else tuple(dict.fromkeys(names))
    order = [name for name in wanted if name in kernels_on(device)]
    if not order:
        raise UserError(
            f"sdpa_backends={list(wanted)}: none of these kernels exists on {device.type} "
            f"(it has {', '.join(kernels_on(device))})"
        )
    return order


def config_problem(value: object) -> str | None:
    """What is wrong with an sdpa_backends value (the check of TrainSpec.sdpa_backends, config/spec.py), or
    None."""
    if value == "auto" or (isinstance(value, str) and value in BACKENDS):
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        return f"must be auto or a list of {', '.join(BACKENDS)} (e.g. [cudnn,flash,math])"
    unknown = [str(name) for name in value if name not in BACKENDS]
    if unknown:
        return f"names no kernel: {', '.join(unknown)} (it takes auto or a list of {', '.join(BACKENDS)})"
    return None


@contextlib.contextmanager
def sdpa_backends(order: Sequence[str]) -> Iterator[None]:
    """Inside: SDPA runs the first of these kernels that takes its inputs, and no other. Compiled code takes the
    kernel chosen when it was traced, so compile inside this too."""
    backends = [BACKENDS[name] for name in order]
    kernels = sdpa_kernel(backends, set_priority=True) if _HAS_SET_PRIORITY else sdpa_kernel(backends)
    with kernels, compile_cache_key(order):
        yield


def compile_cache_key(order: Sequence[str]) -> contextlib.AbstractContextManager:
    """torch's compile caches key a graph without the SDPA order that chose its kernel (pytorch/pytorch#185449):
    a later process asking for another order would load the graph traced under the first one's. The order joins
    the cache key (torch.compiler.config.cache_key_tag, after any tag the user set), and so does the version of
    XSA's custom ops, whose backward the caches would otherwise serve as first traced."""
    config = torch.compiler.config
    if not hasattr(config, "cache_key_tag"):
        return contextlib.nullcontext()
    tag = f"sdpa={','.join(order)}|xsa={xsa.SOURCE_KEY}"
    patched = f"{config.cache_key_tag}|{tag}" if config.cache_key_tag else tag
    return config.patch(cache_key_tag=patched)  # type: ignore[attr-defined]  # torch adds patch to config modules


# What SDPA raises when no allowed kernel takes the shape: on CPU, and on CUDA.
NO_KERNEL = ("No viable backend", "No available kernel")


def backend_used(
    *,
    heads: int,
    seq: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_heads: int | None = None,
    batch: int = 1,
) -> str:
    """The kernel SDPA runs in training, under the current order, for causal attention of q (batch, heads, seq,
    head_dim) over k and v with kv_heads heads: one call, its autograd graph read. Zeros: the choice depends on
    shapes, dtype and device, never on values, and no random number is drawn."""
    kv_heads = kv_heads or heads

    def tensor(h: int) -> torch.Tensor:
        return torch.zeros(batch, h, seq, head_dim, dtype=dtype, device=device, requires_grad=True)

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    try:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    except RuntimeError as e:
        if not any(words in str(e) for words in NO_KERNEL):
            raise
        raise UserError(
            f"sdpa_backends: none of the kernels it allows runs attention of {heads} heads x {seq} positions x "
            f"{head_dim} dims in {str(dtype).removeprefix('torch.')} on {torch.device(device).type}: add math "
            "(it runs every shape)"
        ) from None
    nodes, seen = [out.grad_fn], []
    while nodes:
        node = nodes.pop()
        if node is not None:
            seen.append(node.name())
            nodes.extend(before for before, _ in node.next_functions)
    return next((KERNEL_NODES[name] for name in seen if name in KERNEL_NODES), "math")
