"""The memory a training run needs per device, estimated from its config before the model exists, and the memory it
can have. `xsa-lm train` refuses a run that cannot fit; `xsa-lm plan` prints the estimate for DDP and FSDP.

A model too large for the machine otherwise allocates until the kernel's out-of-memory killer ends it (minutes of
swapping on a laptop) or CUDA raises deep inside the first step; the estimate refuses it in one line instead.
"""

import math
import os
from dataclasses import asdict, dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one training step at its peak, the start of the backward."""

    params: int
    grads: int
    optimizer: int
    activations: int  # one micro-batch's tensors saved for the backward, the cross-entropy's log-probabilities included
    transient: int  # alive at the peak but not saved: the log-probabilities' gradient

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def block_parameters(model: dict) -> int:
    """Weights of one transformer block (no biases): q and o at n_head x head_dim, k and v at n_kv_head x head_dim,
    the MLP, two LayerNorm weights."""
    d, head_dim = model["d_model"], model["head_dim"]
    attn, kv = model["n_head"] * head_dim, (model.get("n_kv_head") or model["n_head"]) * head_dim
    return 2 * d * attn + 2 * d * kv + 2 * d * int(model.get("mlp_ratio", 4) * d) + 2 * d


def parameter_count(model: dict, vocab_size: int) -> int:
    """Blocks, the tied embedding, the LayerNorms after the embedding and before the head."""
    return model["n_layer"] * block_parameters(model) + vocab_size * model["d_model"] + 2 * model["d_model"]


def activation_bytes(model: dict, vocab_size: int, tokens: int, half: bool, checkpointing: bool) -> tuple[int, int]:
    """(saved, transient) for one micro-batch of `tokens`. Saved per layer and token: the two LayerNorm inputs and
    outputs, q, k, v before and after RoPE, the attention output, the MLP's hidden layer before and after GELU;
    with activation checkpointing only each block's input, plus one block recomputed in the backward. The
    cross-entropy keeps fp32 log-probabilities, and its gradient of the same size is alive at the peak."""
    d, width = model["d_model"], model["n_head"] * model["head_dim"]
    per_token_layer = 4 * d + 6 * width + 2 * int(model.get("mlp_ratio", 4) * d)
    value = 2 if half else 4
    layers = model["n_layer"] * d if checkpointing else model["n_layer"] * per_token_layer
    if checkpointing:
        layers += per_token_layer
    logits = tokens * vocab_size * 4
    return tokens * layers * value + logits, logits


def estimate(
    model: dict,
    vocab_size: int,
    micro_batch_size: int,
    block_size: int,
    precision: str,
    strategy: str = "ddp",
    world_size: int = 1,
    activation_checkpointing: bool = False,
) -> MemoryEstimate:
    """Per device. fp32 weights, gradients and AdamW's two moments (mixed precision keeps fp32 masters). DDP holds
    them whole on every device; FSDP shards them over `world_size` and gathers one block at a time (two with
    prefetching) plus the root (the tied embedding) in the compute dtype, with one block's unsharded gradients."""
    half = precision.startswith(("bf16", "16"))
    n = parameter_count(model, vocab_size)
    saved, transient = activation_bytes(
        model=model,
        vocab_size=vocab_size,
        tokens=micro_batch_size * block_size,
        half=half,
        checkpointing=activation_checkpointing,
    )
    if strategy == "fsdp":
        value = 2 if half else 4
        gathered = (2 * block_parameters(model) + vocab_size * model["d_model"]) * value
        shard = math.ceil(n / world_size)
        return MemoryEstimate(
            params=4 * shard + gathered,
            grads=4 * shard + block_parameters(model) * value,
            optimizer=8 * shard,
            activations=saved,
            transient=transient,
        )
    return MemoryEstimate(params=4 * n, grads=4 * n, optimizer=8 * n, activations=saved, transient=transient)


def strategy_kind(strategy) -> str:
    """`fsdp` for a sharding strategy (trainer=fsdp, or a strategy named so), else `ddp` (one device included)."""
    target = strategy.get("_target_", "") if hasattr(strategy, "get") else str(strategy)
    return "fsdp" if "fsdp" in target.lower() or "ModelParallel" in target else "ddp"


def largest_micro_batch(available: int, **kwargs) -> int:
    """The largest micro_batch_size whose estimate fits in `available` bytes (0 if none): memory grows linearly."""
    one, two = estimate(micro_batch_size=1, **kwargs), estimate(micro_batch_size=2, **kwargs)
    per_sequence = two.total - one.total
    return max(0, (available - (one.total - per_sequence)) // per_sequence)


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
        f"{e.optimizer / GIB:.1f}, activations of one micro-batch {(e.activations + e.transient) / GIB:.1f})"
    )
