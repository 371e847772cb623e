"""What a run derives from its config: the device count, checked batch arithmetic, the GPTConfig, the precision,
and Hydra's instantiate with a user's error kept as one line."""

import math
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from xsa_lm.config.checks import check_values
from xsa_lm.errors import UserError
from xsa_lm.model import GPTConfig
from xsa_lm.tracking import resolve_mode

VOCAB_MULTIPLE = 64  # pad the embedding table: matmuls are faster on multiples of 64 (50257 -> 50304)


def build(node, **kwargs):
    """hydra.utils.instantiate, but a UserError raised by the target surfaces as itself (one line for the user)."""
    import hydra
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise


def strategy_kind(strategy) -> str:
    """`fsdp` for a sharding strategy (trainer=fsdp, or a strategy named so), else `ddp` (one device included)."""
    target = strategy.get("_target_", "") if hasattr(strategy, "get") else str(strategy)
    return "fsdp" if "fsdp" in target.lower() or "ModelParallel" in target else "ddp"


def world_size(trainer_cfg: DictConfig) -> int:
    devices = trainer_cfg.get("devices", 1)
    if devices in ("auto", -1, "-1"):
        devices = torch.cuda.device_count() or 1
    elif isinstance(devices, str):  # "0,1" or "2"
        devices = len(devices.split(",")) if "," in devices else int(devices)
    elif not isinstance(devices, int):
        devices = len(devices)
    return devices * int(trainer_cfg.get("num_nodes", 1))


def check_config(cfg: DictConfig) -> dict:
    """Validate what the user can get wrong; returns derived batch quantities."""
    check_values(cfg)
    if cfg.data.block_size > cfg.model.block_size:
        raise UserError(
            f"data.block_size={cfg.data.block_size} is above model.block_size={cfg.model.block_size}: "
            "lower data.block_size or raise model.block_size"
        )
    devices = world_size(cfg.trainer)
    tokens_per_micro_step = cfg.micro_batch_size * devices * cfg.data.block_size
    if cfg.global_batch_tokens % tokens_per_micro_step:
        raise UserError(
            f"global_batch_tokens={cfg.global_batch_tokens} is not divisible by micro_batch_size x devices x "
            f"data.block_size = {cfg.micro_batch_size} x {devices} x {cfg.data.block_size} = {tokens_per_micro_step}: "
            "choose a multiple"
        )
    sharded = strategy_kind(cfg.trainer.strategy) == "fsdp"
    for group in ("diagnostics", "samples"):  # they run a forward on rank 0 alone: under sharding it would hang
        if sharded and cfg.get(group) and cfg[group].every_n_steps:
            raise UserError(
                f"{group}.every_n_steps: not available under trainer=fsdp; run `xsa-lm analyze` or "
                "`xsa-lm generate` on its checkpoints instead"
            )
    sharded_files = sharded and cfg.trainer.strategy.get("save_distributed_checkpoint", True)
    if cfg.checkpoint.get("async_save") and not sharded_files:
        raise UserError(
            "checkpoint.async_save=true: only for sharded checkpoints (trainer=fsdp with "
            "trainer.strategy.save_distributed_checkpoint=true); leave it false here"
        )
    if cfg.logger and cfg.logger.get("wandb"):
        resolve_mode(cfg.logger.wandb.mode)  # a bad mode fails now, before the run directory is written
    return {"devices": devices, "accumulate": cfg.global_batch_tokens // tokens_per_micro_step}


def model_config(cfg: DictConfig, vocab_size: int) -> GPTConfig:
    """GPTConfig from the model group (typed like GPTConfig: xsa_lm/config/schema.py) and the attention group. A null
    model.vocab_size takes the tokenizer's vocabulary, padded to a multiple of 64."""
    fields = cast(dict[str, Any], OmegaConf.to_container(cfg.model, resolve=True))  # a DictConfig: a dict
    architecture = {k: v for k, v in fields.items() if k != "name"}
    if architecture["vocab_size"] is None:
        architecture["vocab_size"] = math.ceil(vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif architecture["vocab_size"] < vocab_size:
        raise UserError(f"model.vocab_size={architecture['vocab_size']} is smaller than the tokenizer's {vocab_size}")
    attention = cfg.attention
    try:
        return GPTConfig(
            **architecture,
            attention=attention.name,
            xsa_eps=attention.eps,
            xsa_layers=xsa_layers(attention.layers, n_layer=architecture["n_layer"]),
            xsa_gate=gate_enabled(attention.gate),
        )
    except ValueError as e:  # GPTConfig's own checks (n_kv_head, n_sinks, ...) are the user's to fix
        raise UserError(f"model: {e}") from None


def xsa_layers(layers, n_layer: int) -> tuple[int, ...] | None:
    """attention.layers: `all` (None: every layer), N (the last N layers) or a list of 0-based layer indices."""
    if layers in ("all", None):
        return None
    if isinstance(layers, int) and not isinstance(layers, bool):
        if not 0 <= layers <= n_layer:
            raise UserError(f"attention.layers={layers}: the last N layers needs 0 <= N <= n_layer={n_layer}")
        return tuple(range(n_layer - layers, n_layer))
    if OmegaConf.is_list(layers) or isinstance(layers, list | tuple):
        return tuple(int(i) for i in layers)
    raise UserError(f"attention.layers must be all, a number of last layers, or a list of layers; got {layers!r}")


def gate_enabled(gate: str) -> bool:
    if gate not in ("none", "tanh"):
        raise UserError(f"attention.gate must be none or tanh, got {gate!r}")
    return gate == "tanh"


def resolve_precision(precision: str) -> str:
    if precision != "auto":
        return precision
    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"
