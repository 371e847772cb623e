"""The memory a training run needs per device, estimated before the model exists, and the memory it can have:
`xsa-lm train` refuses a run that cannot fit (rather than swap or raise inside the first step); `xsa-lm plan` prints
it. The per-token terms count what autograd saves, held to the CPU allocator's peak by tests/test_memory_peak.py."""

import math
import os
from dataclasses import asdict, dataclass

import torch

from xsa_lm.train.devices import uses_cuda

GIB = 2**30
FP32 = 4
LAYERNORM_STATS = 2 * FP32  # mean and 1/std per token, fp32 whatever the input dtype
INDEX = 8  # an int64 token id


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one training step at its peak: the cross-entropy's backward, the first op of the backward,
    while every activation of the micro-batch is still saved."""

    params: int  # fp32 weights (FSDP: the shard, plus the gathered blocks, also fp32)
    grads: int  # fp32 gradients; under DDP with gradient_as_bucket_view they are views into its buckets
    optimizer: int  # AdamW's two moments
    activations: int  # one micro-batch's tensors saved for the backward, the cross-entropy's saved logits included
    transient: int  # alive at the peak but not saved: the cross-entropy backward's N x V buffers, or XSA's
    weight_copies: int = 0  # autocast's compute-dtype copies of the matmul weights, saved for the backward
    ddp_buckets: int = 0  # DDP's fp32 gradient buckets where the gradients are a copy (gradient_as_bucket_view off)

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def widths(model: dict) -> tuple[int, int]:
    """A block's attention and key/value widths."""
    return model["n_head"] * model["head_dim"], (model.get("n_kv_head") or model["n_head"]) * model["head_dim"]


def mlp_width(model: dict) -> int:
    return int(model.get("mlp_ratio", 4) * model["d_model"])


def block_parameters(model: dict) -> int:
    """Weights of one transformer block (no biases): its matmuls and two LayerNorm weights."""
    return 2 * model["d_model"] * (sum(widths(model)) + mlp_width(model) + 1)


def parameter_count(model: dict, vocab_size: int) -> int:
    """Blocks, the tied embedding, the attention sinks, the LayerNorms after the embedding and before the head."""
    embeddings = (vocab_size + model.get("n_sinks", 0)) * model["d_model"]
    return model["n_layer"] * block_parameters(model) + embeddings + 2 * model["d_model"]


def dtype_bytes(precision: str) -> tuple[int, int]:
    """(compute, weights) bytes per value: mixed precision computes in 16 bits on fp32 weights; -true holds 16."""
    compute = 2 if precision.startswith(("bf16", "16")) else 4
    return compute, compute if precision.endswith("-true") else 4


def block_saved_per_token(
    model: dict, *, compute: int, residual: int, exclusive: bool = False, compiled: bool = False
) -> dict[str, int]:
    """Bytes one block saves for the backward per token, by term: both LayerNorms' inputs (residual dtype) and
    statistics, their outputs cast for the qkv and fc matmuls, the qkv output (v, a view, keeps it whole), q and k
    after RoPE, the attention output and its logsumexp, the MLP's hidden layer before and after GELU; XSA's
    (y . v) / ||v||^2 per head and 1 / ||v||^2 per KV head (its custom ops save the same compiled). Compiled: the
    attention branch's output replaces the second residual (recomputed from it)."""
    d, heads, (width, kv_width) = model["d_model"], model["n_head"], widths(model)
    xsa = FP32 * (heads + kv_width // model["head_dim"])
    return {
        "layernorm_inputs": 2 * residual * d if not compiled else (residual + compute) * d,
        "layernorm_stats": 2 * LAYERNORM_STATS,
        "matmul_inputs": 2 * compute * d,
        "qkv": compute * (width + 2 * kv_width),
        "rope": compute * (width + kv_width),
        "attention_output": compute * width + FP32 * heads,
        "mlp_hidden": 2 * compute * mlp_width(model),
        "xsa": xsa if exclusive else 0,
    }


def xsa_transient_per_token(model: dict, *, compute: int, compiled: bool = False) -> int:
    """The most bytes per token one XSA layer's backward temporaries hold at once (the output projection's backward
    making y's gradient): the gradients of z (compute dtype), of v and of y in fp32, two fp32 numbers per head; in
    16 bits also v's fp32 copy and the gradient promoted for its product with v. Compiled (the ops' bodies on CUDA,
    one kernel each way; measured before XSA became custom ops): the gradients of y and v in the compute dtype and
    one fp32 number per head."""
    heads, (width, kv_width) = model["n_head"], widths(model)
    if compiled:
        return compute * (width + kv_width) + FP32 * heads
    promoted = 0 if compute == FP32 else FP32 * (kv_width + width)
    return compute * (width + kv_width) + FP32 * width + promoted + 2 * FP32 * heads


def head_saved_per_token(
    model: dict, vocab_size: int, *, compute: int, residual: int, compiled: bool = False
) -> dict[str, int]:
    """Bytes saved per token outside the blocks: token ids, both outer LayerNorms' inputs and statistics, the head's
    input, and the cross-entropy's (eager: fp32 log-probabilities; compiled: the logits in the compute dtype).
    Chunked (loss_chunk): the head input's gradient, its input in the residual dtype too where autocast casts it,
    and each token's loss and its mask."""
    d = model["d_model"]
    if model.get("loss_chunk"):
        cross_entropy = residual * d + (residual * d if compute != residual else 0) + FP32 + 1
    else:
        cross_entropy = vocab_size * (compute if compiled else FP32)
    return {
        "embedding_and_head": 2 * INDEX + 2 * (residual * d + LAYERNORM_STATS) + compute * d,
        "cross_entropy": cross_entropy,
    }


def cross_entropy_transient_per_token(vocab_size: int, *, compute: int, compiled: bool = False) -> int:
    """Alive at the peak besides the saved logits. Eager: the log-probabilities' gradient and log_softmax backward's
    output, fp32. Compiled (measured): the logits' gradient and one intermediate of its size, in the compute dtype."""
    return vocab_size * (2 * FP32 if not compiled else 2 * compute)


def chunked_cross_entropy_bytes(model: dict, vocab_size: int, tokens: int, *, compute: int, weights: int) -> int:
    """The chunked loss's peak (model/loss.py), in the forward's last chunk, beside the saved activations: the output
    weight's fp32 gradient, its copy in the compute dtype, a chunk's targets and mask, and the larger of two moments
    of a chunk (C tokens x V): its logits and log-probabilities, fp32; or its gradient (fp32, in 16 bits also its
    copy) and losses while its share of the weight's gradient is added (a V x d product, in 16 bits also promoted to
    fp32). The CPU allocator's to the byte (tests/test_loss.py); compiled taken as eager (not measured)."""
    C, Vd = min(model["loss_chunk"], tokens), vocab_size * model["d_model"]
    adding = FP32 * (Vd + C) if compute == FP32 else compute * C * vocab_size + (compute + FP32) * Vd + FP32 * C
    chunk = max(2 * FP32 * C * vocab_size, FP32 * C * vocab_size + adding) + (INDEX + 1) * C  # + targets, mask
    return FP32 * Vd + (compute * Vd if compute != weights else 0) + chunk


def estimate(
    model: dict,
    vocab_size: int,
    micro_batch_size: int,
    block_size: int,
    precision: str,
    strategy: str = "ddp",
    world_size: int = 1,
    activation_checkpointing: bool = False,
    *,
    compiled: bool = False,
    exclusive: bool = False,
    gradient_as_bucket_view: bool = True,
    accumulation: int = 1,
) -> MemoryEstimate:
    """Per device: weights, gradients and AdamW's two moments (fp32 masters under mixed precision, plus autocast's
    16-bit matmul weight copies, kept by the backward). DDP holds them whole, its gradients in its buckets (a second
    copy without gradient_as_bucket_view); FSDP shards them over `world_size`, gathering two blocks (prefetch) and
    the tied embedding in fp32, with one block's unsharded gradients, or every one while accumulating (the
    reduction waits for the step's last micro-batch). exclusive: every layer keeps XSA's numbers (its variant's
    exclusive_memory, model/attention.py).

    Activations: what the backward starts with (the sinks pass every block too), and the most its ops add at once:
    the cross-entropy's buffers or one XSA layer's temporaries, the larger (XSA's come after the former are freed: an
    overstatement by up to those). With activation checkpointing each block keeps only its input, and the block
    recomputed in the backward comes after the cross-entropy's buffers are freed."""
    (compute, weights), n, xsa = dtype_bytes(precision), parameter_count(model, vocab_size), exclusive
    tokens, positions = micro_batch_size * block_size, micro_batch_size * (block_size + model.get("n_sinks", 0))
    block = block_saved_per_token(model, compute=compute, residual=weights, exclusive=xsa, compiled=compiled)
    outside = head_saved_per_token(model, vocab_size, compute=compute, residual=weights, compiled=compiled)
    layer = sum(block.values())
    xsa_transient = xsa_transient_per_token(model, compute=compute, compiled=compiled) if xsa else 0
    if model.get("loss_chunk"):
        cross_entropy = chunked_cross_entropy_bytes(model, vocab_size, tokens, compute=compute, weights=weights)
    else:
        cross_entropy = tokens * cross_entropy_transient_per_token(vocab_size, compute=compute, compiled=compiled)
    transient = max(cross_entropy, positions * xsa_transient)
    blocks = model["n_layer"] * (weights * model["d_model"] if activation_checkpointing else layer)
    if activation_checkpointing:
        transient = max(transient, positions * (layer + xsa_transient) - tokens * outside["cross_entropy"])
    saved = positions * blocks + tokens * sum(outside.values())
    copies = autocast_copies(
        model, vocab_size, precision, exclusive=exclusive, compiled=compiled, checkpointing=activation_checkpointing
    )
    if strategy == "fsdp":  # fp32 parameters gathered (no FSDP2 mixed-precision policy): autocast copies as DDP's
        gathered = (2 * block_parameters(model) + vocab_size * model["d_model"]) * weights
        shard = math.ceil(n / world_size)
        grads = weights * shard + (4 * n if accumulation > 1 else block_parameters(model) * weights)
        return MemoryEstimate(weights * shard + gathered, grads, 2 * weights * shard, saved, transient, copies)
    buckets = weights * n if world_size > 1 and not gradient_as_bucket_view else 0
    return MemoryEstimate(weights * n, weights * n, 2 * weights * n, saved, transient, copies, buckets)


def autocast_copies(
    model: dict, vocab_size: int, precision: str, *, exclusive: bool, compiled: bool, checkpointing: bool
) -> int:
    """Mixed precision: each matmul weight cast once per forward (autocast's cache), kept by the backward; with
    activation checkpointing only the head's and the recomputed block's. XSA keeps W_o in fp32 (its op casts it)."""
    compute, weights = dtype_bytes(precision)
    if compute == weights:
        return 0
    d = model["d_model"]
    block = block_parameters(model) - 2 * d  # its Linear weights
    if exclusive:
        block -= widths(model)[0] * d
    head = 0 if model.get("loss_chunk") else vocab_size * d  # the chunked loss casts its own (transient)
    return compute * ((1 if checkpointing else model["n_layer"]) * block + head)


def largest_micro_batch(available: int, **kwargs) -> int:
    """The largest micro_batch_size whose estimate fits in `available` bytes (0 if none): memory grows with it (not
    linearly: a chunked loss's chunk stops growing), so a doubling then a bisection."""
    fits = lambda m: estimate(micro_batch_size=m, **kwargs).total <= available  # noqa: E731
    high = 1
    while fits(high):
        high *= 2
    low = high // 2  # fits, or 0
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def largest_micro_batches(available: int, loss_chunk: int, **kwargs) -> dict[str, int]:
    """The largest micro-batch that fits, with the whole logits and with the loss `loss_chunk` tokens at a time."""
    model = kwargs.pop("model")
    return {
        name: largest_micro_batch(available, model={**model, "loss_chunk": chunk}, **kwargs)
        for name, chunk in (("whole_logits", 0), ("chunked_loss", loss_chunk))
    }


def available_bytes(accelerator: str) -> tuple[int, str]:
    """Memory a run can use on its device: free CUDA memory on a GPU run, else the host's available memory."""
    if uses_cuda(accelerator):
        free, _ = torch.cuda.mem_get_info()
        return free, f"free on {torch.cuda.get_device_name()}"
    try:
        with open("/proc/meminfo") as f:  # Linux's MemAvailable: what can be allocated without swapping
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], "available host memory"
    except (FileNotFoundError, KeyError):  # macOS: the physical memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"


def describe(e: MemoryEstimate) -> str:
    gib = {k: f"{v / GIB:.1f}" for k, v in e.as_dict().items()}
    names = {"weight_copies": "16-bit weight copies", "ddp_buckets": "DDP buckets"}
    extra = "".join(f", {name} {gib[k]}" for k, name in names.items() if getattr(e, k))
    return (
        f"{gib['total']} GiB (weights {gib['params']}, gradients {gib['grads']}, AdamW state {gib['optimizer']}"
        f"{extra}, activations of one micro-batch {(e.activations + e.transient) / GIB:.1f})"
    )
