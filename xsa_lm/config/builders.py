"""What a run derives from its config: the device count, checked batch arithmetic, the GPTConfig, the precision,
and Hydra's instantiate with a user's error kept as one line."""

import math
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from xsa_lm.compat import PRECISIONS, lightning_device_settings, lightning_precision_name
from xsa_lm.config.checks import check_values
from xsa_lm.config.schema import model_error
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
    if devices in ("auto", -1, "-1"):  # every device: the GPUs of a GPU run; on CPU, Lightning takes one
        on_gpu = trainer_cfg.get("accelerator", "auto") in ("auto", "gpu", "cuda")
        devices = (torch.cuda.device_count() if on_gpu else 0) or 1
    elif isinstance(devices, str):  # "0,1" or "2"
        devices = len(devices.split(",")) if "," in devices else int(devices)
    elif not isinstance(devices, int):
        devices = len(devices)
    return devices * int(trainer_cfg.get("num_nodes", 1))


def check_config(cfg: DictConfig) -> dict[str, int]:
    """Validate what the user can get wrong; returns the devices and `accumulate`: micro-batches per optimizer step."""
    check_values(cfg)
    model_config(cfg, vocab_size=1)  # attention.layers and .gate as the model takes them, before the data is prepared
    resolve_precision(cfg.trainer.precision)  # a name Lightning accepts; check_trainer asks this machine
    if cfg.data.block_size > cfg.model.block_size:
        raise UserError(
            f"data.block_size={cfg.data.block_size} is above model.block_size={cfg.model.block_size}: "
            "lower data.block_size or raise model.block_size"
        )
    if cfg.val_position_buckets > cfg.data.block_size:  # spans without a position would be reported empty
        raise UserError(
            f"val_position_buckets={cfg.val_position_buckets} is above data.block_size={cfg.data.block_size}: "
            "each span needs a position; lower it"
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
    rank = cfg.faults.get("inject_nan_on_rank")
    if cfg.faults.get("inject_nan_at_step") is not None and rank is not None and rank >= devices:
        raise UserError(
            f"faults.inject_nan_on_rank={rank}: this run has {devices} device(s), ranks 0 to {devices - 1}; the NaN "
            "would never be injected"
        )
    profile = cfg.get("profile")
    if profile and profile.start_step is not None and profile.start_step + profile.steps > cfg.trainer.max_steps:
        raise UserError(
            f"profile.start_step={profile.start_step} + profile.steps={profile.steps} is beyond trainer.max_steps="
            f"{cfg.trainer.max_steps}: the trace would be cut short or never start; profile earlier steps"
        )
    if cfg.logger and cfg.logger.get("wandb"):
        resolve_mode(cfg.logger.wandb.mode)  # a bad mode fails now, before the run directory is written
    return {"devices": devices, "accumulate": cfg.global_batch_tokens // tokens_per_micro_step}


def settle_schedule(cfg: DictConfig) -> str | None:
    """The LR schedule's length (scheduler.total_steps; null: trainer.max_steps) and warmup, resolved into cfg, which
    config.yaml saves: a resume that extends max_steps keeps the schedule. A warmup longer than the schedule would
    never reach optim.lr, while the run reports it: it is clipped to the schedule's length, so that the LR reaches
    optim.lr at the last step, and the returned warning says so (a short try-out with the default warmup still runs)."""
    scheduler = cfg.scheduler
    if "total_steps" not in scheduler or "warmup_steps" not in scheduler:
        return None
    if scheduler.total_steps is None:
        scheduler.total_steps = cfg.trainer.max_steps
    total, warmup = scheduler.total_steps, scheduler.warmup_steps
    if warmup <= total:
        return None
    scheduler.warmup_steps = total
    extra = cfg.trainer.max_steps - total
    final = cfg.optim.lr * scheduler.get("min_lr_ratio", 1.0)
    after = f" (the {extra} steps after it run at its final LR {final:g})" if extra > 0 else ""
    return (
        f"WARNING: scheduler.warmup_steps={warmup} is longer than the LR schedule's {total} steps "
        f"(scheduler.total_steps, default trainer.max_steps): clipped to {total}, so the LR reaches optim.lr="
        f"{cfg.optim.lr:g} at the schedule's last step{after}; set scheduler.warmup_steps below {total} to have a "
        "decay after it"
    )


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
            xsa_layers=xsa_layers(attention.layers, n_layer=architecture["n_layer"], attention=attention.name),
            xsa_gate=attention.gate == "tanh",  # none or tanh (config/schema.py checks it)
        )
    except ValueError as e:  # GPTConfig's own checks (n_kv_head, n_sinks, ...), each opening with its field
        raise model_error(e) from None


def xsa_layers(layers, n_layer: int, attention: str = "xsa") -> tuple[int, ...] | None:
    """attention.layers: `all` (None: every layer), N (the last N layers) or a list of distinct 0-based layer
    indices. Under attention=xsa at least one layer: XSA on none is SA, which the run would report as XSA."""
    if layers in ("all", None):
        return None
    layers = OmegaConf.to_container(layers) if OmegaConf.is_list(layers) else layers
    if isinstance(layers, int) and not isinstance(layers, bool):
        if not 0 <= layers <= n_layer:
            raise UserError(f"attention.layers={layers}: the last N layers needs 0 <= N <= model.n_layer={n_layer}")
        chosen = tuple(range(n_layer - layers, n_layer))
    elif isinstance(layers, list | tuple):
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layer for i in layers):
            raise UserError(
                f"attention.layers={layers}: each layer is a 0-based index below model.n_layer={n_layer}, e.g. "
                f"[0,{n_layer - 1}]"
            )
        if len(set(layers)) != len(layers):
            raise UserError(f"attention.layers={layers} names a layer twice: list each layer once")
        chosen = tuple(layers)
    else:
        raise UserError(f"attention.layers must be all, a number of last layers, or a list of layers; got {layers!r}")
    if attention == "xsa" and not chosen:
        raise UserError(f"attention.layers={layers} puts XSA on no layer, which is plain SA: use attention=sa")
    return chosen


def resolve_precision(precision: str, accelerator: str = "auto") -> str:
    """trainer.precision by Lightning's name for it (`16` is `16-mixed`); `auto` (ours): bf16-mixed on a GPU run
    where the GPU has bf16, else 32-true."""
    if precision == "auto":
        on_gpu = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        return "bf16-mixed" if on_gpu and torch.cuda.is_bf16_supported() else "32-true"
    try:
        return lightning_precision_name(precision)
    except ValueError:
        raise UserError(
            f"trainer.precision={precision} is not a precision Lightning accepts: use auto or one of "
            f"{', '.join(PRECISIONS)}"
        ) from None


def check_trainer(trainer_cfg: DictConfig, strategy: object) -> str:
    """The trainer settings as Lightning's Trainer will take them on this machine, before anything is written: an
    accelerator it lacks, devices it cannot use, a combination Lightning refuses, or a precision Lightning would
    silently replace (16-mixed on CPU runs bf16-mixed) is refused in one line naming the key. `strategy`: what the
    Trainer gets (a _target_ node is built). Returns the precision the run trains in."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    accelerator = trainer_cfg.accelerator
    precision = resolve_precision(trainer_cfg.precision, accelerator=accelerator)
    if OmegaConf.is_dict(strategy) or isinstance(strategy, dict):
        strategy = build(strategy)
    devices = trainer_cfg.devices
    settings = {
        "accelerator": accelerator,
        "devices": OmegaConf.to_container(devices) if OmegaConf.is_list(devices) else devices,
        "num_nodes": trainer_cfg.num_nodes,
        "precision": precision,
        "strategy": strategy,
    }
    given: dict = {}
    for key, value in settings.items():  # one more at a time: Lightning's refusal is the last key's
        given[key] = value
        try:
            effective = lightning_device_settings(**given)
        except (ValueError, TypeError, RuntimeError, ImportError, MisconfigurationException) as e:
            reason = " ".join(str(e).split()).rstrip(".")
            raise UserError(
                f"trainer.{key}={shown_setting(trainer_cfg, key)}: Lightning cannot train so on this machine "
                f"({reason}); {setting_fix(key)}"
            ) from None
    if effective != precision:
        raise UserError(
            f"trainer.precision={trainer_cfg.precision}: Lightning would train in {effective} on this "
            f"trainer.accelerator={accelerator}, not {precision}: set trainer.precision={effective} or 32-true"
        )
    return precision


def shown_setting(trainer_cfg: DictConfig, key: str) -> object:
    """A trainer setting as the user wrote it; a strategy node by its class."""
    value = trainer_cfg[key]
    if OmegaConf.is_dict(value):
        return str(value.get("_target_", "")).rpartition(".")[2] or dict(value)
    return OmegaConf.to_container(value) if OmegaConf.is_list(value) else value


def setting_fix(key: str) -> str:
    """How to fix a trainer setting Lightning refuses on this machine."""
    if key == "accelerator":
        from lightning.pytorch.accelerators import AcceleratorRegistry

        here = sorted(name for name in AcceleratorRegistry if AcceleratorRegistry[name]["accelerator"].is_available())
        return f"this machine has trainer.accelerator={' or '.join(here)} (trainer=cpu; trainer=gpu where a GPU is)"
    return {
        "devices": "set trainer.devices to a number of devices this machine has, e.g. 1",
        "num_nodes": "set trainer.num_nodes to the number of nodes the run is launched on",
        "precision": "choose another trainer.precision, e.g. 32-true",
    }.get(key, "choose another trainer option or trainer.precision")
