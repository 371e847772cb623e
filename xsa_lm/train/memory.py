"""The memory a training run needs, estimated from its config before the model exists, and the memory it can have.

A model too large for the machine otherwise allocates until the kernel's out-of-memory killer ends it (minutes of
swapping on a laptop) or CUDA raises deep inside the first step; the estimate refuses it in one line instead.
"""

import os
from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one training step."""

    params: int
    grads: int
    optimizer: int
    activations: int  # one micro-batch's tensors saved for the backward, logits included

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def parameter_count(n_layer: int, d_model: int, n_head: int, head_dim: int, n_kv_head: int | None, vocab_size: int,
                    mlp_ratio: float) -> int:  # fmt: skip
    """Weights of the GPT (no biases): q and o at n_head x head_dim, k and v at n_kv_head x head_dim, the MLP, the
    tied embedding, and LayerNorm weights."""
    attn_width, kv_width = n_head * head_dim, (n_kv_head or n_head) * head_dim
    mlp = 2 * d_model * int(mlp_ratio * d_model)
    per_layer = 2 * d_model * attn_width + 2 * d_model * kv_width + mlp + 2 * d_model
    return n_layer * per_layer + vocab_size * d_model + 2 * d_model


def activation_bytes(n_layer: int, d_model: int, n_head: int, head_dim: int, vocab_size: int, mlp_ratio: float,
                     tokens: int, bytes_per_value: int) -> int:  # fmt: skip
    """Tensors kept for the backward per micro-batch: per layer and token, the two LayerNorm inputs and outputs,
    q, k, v (before and after RoPE), the attention output, the MLP's hidden layer before and after GELU; and the
    logits with their gradient (fp32 in the cross-entropy)."""
    attn_width = n_head * head_dim
    per_token_layer = 4 * d_model + 6 * attn_width + 2 * int(mlp_ratio * d_model)
    return n_layer * tokens * per_token_layer * bytes_per_value + 2 * tokens * vocab_size * 4


def estimate(model: dict, vocab_size: int, micro_batch_size: int, block_size: int, precision: str) -> MemoryEstimate:
    """fp32 weights, gradients and AdamW's two moments (mixed precision keeps fp32 masters too)."""
    n = parameter_count(model["n_layer"], model["d_model"], model["n_head"], model["head_dim"],
                        model.get("n_kv_head"), vocab_size, model.get("mlp_ratio", 4))  # fmt: skip
    half = precision.startswith(("bf16", "16"))
    acts = activation_bytes(model["n_layer"], model["d_model"], model["n_head"], model["head_dim"], vocab_size,
                            model.get("mlp_ratio", 4), micro_batch_size * block_size, 2 if half else 4)  # fmt: skip
    return MemoryEstimate(params=4 * n, grads=4 * n, optimizer=8 * n, activations=acts)


def available_bytes(accelerator: str) -> tuple[int, str]:
    """Memory a run can use on its device: free CUDA memory on a GPU run, else the host's available memory."""
    if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return free, f"free on {torch.cuda.get_device_name()}"
    try:
        with open("/proc/meminfo") as f:  # Linux's MemAvailable: what can be allocated without swapping
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], "available host memory"
    except (FileNotFoundError, KeyError):  # macOS: the physical memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"


def describe(e: MemoryEstimate) -> str:
    return (
        f"{e.total / GIB:.1f} GiB (weights {e.params / GIB:.1f}, gradients {e.grads / GIB:.1f}, AdamW state "
        f"{e.optimizer / GIB:.1f}, activations of one micro-batch {e.activations / GIB:.1f})"
    )
