"""Types and ranges of every value a user can set for `xsa-lm train`, checked before anything is built or written.

Hydra types a command-line value by its look (`1.5` is a float, `-1` an int), so `trainer.max_steps=1.5` or `seed=-1`
compose fine and would fail deep inside torch or Lightning, or worse, run. Each rule names the key and what it takes.
"""

import math

from omegaconf import DictConfig, ListConfig

from xsa_lm.config.schema import check_known_keys
from xsa_lm.errors import UserError
from xsa_lm.model.sdpa import config_problem as sdpa_backends_problem

SEED_MAX = 2**32 - 1  # numpy's seed range, which Lightning's seed_everything enforces


def _int(minimum: int, maximum: int | None = None, nullable: bool = False):
    def check(value) -> str | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer{' or null' if nullable else ''}"
        if value < minimum or (maximum is not None and value > maximum):
            return f"must be >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        return None

    return check


def _number(low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False, nullable=False):
    def check(value) -> str | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"must be a finite number{' or null' if nullable else ''}"
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if below or above:
            if high == math.inf:
                return f"must be {'>' if low_open else '>='} {low:g}"
            left, right = "(" if low_open else "[", ")" if high_open else "]"
            return f"must be in {left}{low:g}, {high:g}{right}"
        return None

    return check


def _bool(value) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _one_only(value) -> str | None:
    # ModelParallelStrategy would build a tensor-parallel mesh that the model never uses: wrong, silently.
    if value == 1 and not isinstance(value, bool):
        return None
    return "must be 1: tensor parallelism is not implemented (trainer=fsdp shards data parallel only)"


def _text(value) -> str | None:
    # Hydra types a value by its look: samples.prompt=1e3 arrives as 1000.0, =true as True, not as typed.
    if isinstance(value, str):
        return None
    kind = type(value).__name__
    return f"must be text (Hydra read it as a {kind}): quote it for Hydra, e.g. samples.prompt='\"1e3\"'"


def _resume(value) -> str | None:
    wanted = "must be auto, null or a checkpoint path"
    if isinstance(value, str) and value != "auto" and value.strip().lower() == "auto":  # AUTO, Auto: not a path
        return f"{wanted}: did you mean resume=auto?"
    if value is None or (isinstance(value, str) and value.strip()):
        return None
    return f"{wanted} (quote a path Hydra reads as a number or boolean, e.g. resume='\"5\"')"


def _bool_or_auto(value) -> str | None:
    return None if isinstance(value, bool) or value == "auto" else "must be true, false or auto"


def _int_or_auto(minimum: int):
    number = _int(minimum)

    def check(value) -> str | None:
        problem = None if value == "auto" else number(value)
        return f"{problem} or auto" if problem else None

    return check


def _devices(value) -> str | None:
    """Lightning's forms: N > 0, -1 or auto (every device), a list of distinct device indices, or the same as text
    ("2", "0,1")."""
    if isinstance(value, str) and value != "auto":
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if parts and all(p.lstrip("-").isdigit() for p in parts):
            value = [int(p) for p in parts] if "," in value else int(parts[0])
    if value == "auto" or value == -1 or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    indices = list(value) if isinstance(value, list | ListConfig) else []
    if indices and all(_int(0)(i) is None for i in indices) and len(set(indices)) == len(indices):
        return None
    return "must be a number of devices >= 1, -1 or auto (every device), or a list of distinct device indices"


def _betas(value) -> str | None:
    if (
        not isinstance(value, list | ListConfig)
        or len(value) != 2
        or any(isinstance(b, bool) or not isinstance(b, int | float) or not 0 <= b < 1 for b in value)
    ):
        return "must be two numbers in [0, 1), e.g. [0.9, 0.95]"
    return None


RULES = {
    "seed": _int(0, SEED_MAX),
    "init_seed": _int(0, SEED_MAX, nullable=True),
    "resume": _resume,
    "global_batch_tokens": _int(1),
    "micro_batch_size": _int(1),
    "val_every_steps": _int(1),
    "val_position_buckets": _int(1),
    "compile": _bool_or_auto,
    "sdpa_backends": sdpa_backends_problem,
    "reuse_host_memory": _bool,
    "progress_bar": _bool,
    "check_memory": _bool,
    "checkpoint.keep_last": _int(0),
    "checkpoint.every_n_steps": _int(1, nullable=True),
    "checkpoint.async_save": _bool,
    "faults.skip_nonfinite_batches": _int(0),
    "faults.spike_factor": _number(0, low_open=True, nullable=True),
    "faults.inject_nan_at_step": _int(0, nullable=True),
    "faults.inject_nan_on_rank": _int(0, nullable=True),
    "diagnostics.every_n_steps": _int(1, nullable=True),
    "diagnostics.sequences": _int(1),
    "diagnostics.chunk": _int(1),
    "samples.every_n_steps": _int(1, nullable=True),
    "samples.max_new_tokens": _int(1),
    "samples.temperature": _number(0),
    "samples.top_k": _int(1, nullable=True),
    "samples.prompt": _text,
    "profile.start_step": _int(0, nullable=True),
    "profile.steps": _int(1),
    "model.n_layer": _int(1),
    "model.d_model": _int(1),
    "model.n_head": _int(1),
    "model.head_dim": _int(1),
    "model.block_size": _int(1),
    "model.vocab_size": _int(1, nullable=True),
    "model.mlp_ratio": _number(0, low_open=True),
    "model.dropout": _number(0, 1, high_open=True),
    "model.rope_base": _number(0, low_open=True),
    "model.init_std": _number(0, low_open=True),
    "model.n_kv_head": _int(1, nullable=True),
    "model.n_sinks": _int(0),
    "attention.eps": _number(0, low_open=True),
    "data.block_size": _int(1),
    "data.num_workers": _int_or_auto(0),
    "optim.lr": _number(0, low_open=True),
    "optim.eps": _number(0, low_open=True),
    "optim.weight_decay": _number(0),
    "optim.betas": _betas,
    "scheduler.warmup_steps": _int(0),
    "scheduler.min_lr_ratio": _number(0, 1),
    "scheduler.total_steps": _int(1, nullable=True),
    "trainer.max_steps": _int(1),
    "trainer.log_every_n_steps": _int(1),
    "trainer.num_nodes": _int(1),
    "trainer.devices": _devices,
    "trainer.gradient_clip_val": _number(0, nullable=True),
    "trainer.activation_checkpointing": _bool,
}
# Keys of a node that only some options have: trainer.strategy is `auto` or a strategy's own arguments.
WHERE_PRESENT = {
    "trainer.strategy.tensor_parallel_size": _one_only,  # trainer=fsdp
}


def lookup(cfg: DictConfig, key: str) -> object:
    """The value at a dotted key, or KeyError (the class) where the config has no such key."""
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return KeyError
        node = node[part]
    return node


def check_values(cfg: DictConfig) -> None:
    """Keys no schema has, then every key of RULES (a missing one is a mistake too: a rule never goes unchecked) and
    of WHERE_PRESENT that the config has, in one line naming each bad value."""
    check_known_keys(cfg)
    bad = []
    for key, rule in {**RULES, **WHERE_PRESENT}.items():
        value = lookup(cfg, key)
        if value is KeyError:
            if key in RULES:
                bad.append(f"{key} is missing from the config: set it")
            continue
        problem = rule(value)
        if problem:
            bad.append(f"{key}={value} {problem}")
    if bad:
        raise UserError("; ".join(bad))
