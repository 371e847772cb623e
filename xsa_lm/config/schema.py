"""Typed schemas of the training config: every key of configs/train.yaml and of each option of its groups, its
field the one place of its type, default (`???`: the file sets it), what it is, and its check (knob: checks.py
check_values names the key, the value and what it takes). The files hold the values and say why. A renamed or
misspelt key in a file fails when Hydra composes the config, one appended past a schema (`+optim.lrr=1`) when the run
starts (check_known_keys). The model group mirrors GPTConfig, whose own check is the one range check of the model.
"""

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from xsa_lm.errors import UserError
from xsa_lm.model.config import GPTConfig
from xsa_lm.model.sdpa import config_problem as sdpa_backends_problem

SEED_MAX = 2**32 - 1  # numpy's seed range, which Lightning's seed_everything enforces
Rule = Callable[[Any], str | None]  # a value -> what is wrong with it (None: nothing)
TYPE_WANTED = {int: "must be an integer", float: "must be a finite number", bool: "must be true or false"}


@dataclass(frozen=True)
class Check:
    """What a field's value must be beyond its type: within bounds (gt, lt: open), or what a rule of its own says
    (of its type too); a refusal ends with the hint, if any (what the setting does)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    rule: Rule | None = None
    hint: str | None = None

    def problem(self, annotation: Any, value: Any) -> str | None:
        """What is wrong with a value of a field annotated `annotation` (null, where it allows it: nothing)."""
        kinds = options(annotation)
        if value is None and NoneType in kinds:
            return None
        problem = self.rule(value) if self.rule else self.type_problem(kinds, value)
        return f"{problem} ({self.hint})" if problem and self.hint else problem

    def type_problem(self, kinds: tuple, value: Any) -> str | None:
        words = [word for kind in kinds if get_origin(kind) is Literal for word in get_args(kind)]
        if isinstance(value, str) and value in words:
            return None
        kind = next((k for k in kinds if k in TYPE_WANTED), None)
        if kind is None:
            return f"must be one of {', '.join(words)}"
        if is_a(kind, value):
            problem = self.bounds_problem(kind, value)
        else:
            problem = TYPE_WANTED[kind] + (" or null" if NoneType in kinds else "")
        if problem and words:
            return ("must be true, false" if kind is bool else problem) + f" or {', '.join(words)}"
        return problem

    def bounds_problem(self, kind: type, value: float) -> str | None:
        low, high = self.ge if self.gt is None else self.gt, self.le if self.lt is None else self.lt
        below = low is not None and (value < low or (value == low and self.gt is not None))
        above = high is not None and (value > high or (value == high and self.lt is not None))
        if not (below or above):
            return None
        if kind is int:
            return f"must be >= {low}" + (f" and <= {high}" if high is not None else "")
        if high is None:
            return f"must be {'>=' if self.gt is None else '>'} {low:g}"
        return f"must be in {'[' if self.gt is None else '('}{low:g}, {high:g}{']' if self.lt is None else ')'}"


# A key a resume may change (config/resume.py): how long, how often, where and how fast; never what the model sees or
# how it learns. A node's: all of its keys.
FREE = {"free_on_resume": True}


def knob(default: Any = MISSING, *, free: bool = False, **check: Any) -> Any:
    """A checked field (check_values): Check's bounds or rule, e.g. knob(ge=1), knob(rule=_resume); free: FREE."""
    return field(default=default, metadata={"check": Check(**check), **(FREE if free else {})})


def options(annotation: Any) -> tuple:
    """The types a union annotation allows (`int | None` -> int, NoneType); a plain one alone."""
    return get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)


def is_a(kind: type, value: object) -> bool:
    if isinstance(value, bool):  # an int to Python, never a number here
        return kind is bool
    if kind is int:
        return isinstance(value, int)
    return kind is float and isinstance(value, int | float) and math.isfinite(value)


def _text(value: object) -> str | None:
    # Hydra types a value by its look: samples.prompt=1e3 arrives as 1000.0, =true as True, not as typed.
    if isinstance(value, str):
        return None
    kind = type(value).__name__
    return f"must be text (Hydra read it as a {kind}): quote it for Hydra, e.g. samples.prompt='\"1e3\"'"


def _resume(value: object) -> str | None:
    wanted = "must be auto, null or a checkpoint path"
    if isinstance(value, str) and value != "auto" and value.strip().lower() == "auto":  # AUTO, Auto: not a path
        return f"{wanted}: did you mean resume=auto?"
    if value is None or (isinstance(value, str) and value.strip()):
        return None
    return f"{wanted} (quote a path Hydra reads as a number or boolean, e.g. resume='\"5\"')"


def _devices(value: Any) -> str | None:
    """Lightning's forms: N > 0, -1 or auto (every device), a list of distinct device indices, or the same as text
    ("2", "0,1")."""
    if isinstance(value, str) and value != "auto":
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if parts and all(p.lstrip("-").isdigit() for p in parts):
            value = [int(p) for p in parts] if "," in value else int(parts[0])
    if value == "auto" or value == -1 or (is_a(int, value) and value >= 1):
        return None
    indices = list(value) if isinstance(value, list | ListConfig) else []
    if indices and all(is_a(int, i) and i >= 0 for i in indices) and len(set(indices)) == len(indices):
        return None
    return "must be a number of devices >= 1, -1 or auto (every device), or a list of distinct device indices"


def _betas(value: Any) -> str | None:
    pair = (
        isinstance(value, list | ListConfig) and len(value) == 2 and all(is_a(float, b) and 0 <= b < 1 for b in value)
    )
    return None if pair else "must be two numbers in [0, 1), e.g. [0.9, 0.95]"


def _one_only(value: object) -> str | None:
    # ModelParallelStrategy would build a tensor-parallel mesh that the model never uses: wrong, silently.
    if is_a(int, value) and value == 1:
        return None
    return "must be 1: tensor parallelism is not implemented (trainer=fsdp shards data parallel only)"


# GPTConfig fields that the attention group sets, by their key there (attention.name, .eps, .layers, .gate).
ATTENTION_FIELDS = {"attention": "name", "xsa_eps": "eps", "xsa_layers": "layers", "xsa_gate": "gate"}


def model_error(error: ValueError) -> UserError:
    """GPTConfig's refusal, which opens with its field, as one line naming the config key (model.n_sinks=...)."""
    name = re.split(r"\W", str(error), maxsplit=1)[0]
    key = f"attention.{ATTENTION_FIELDS[name]}" if name in ATTENTION_FIELDS else f"model.{name}"
    return UserError(f"{key}{str(error)[len(name) :]}")


# GPTConfig's architecture fields with its defaults, so that the schema cannot drift from the model; vocab_size
# defaults to null: the tokenizer's vocabulary, padded (builders.py model_config).
ModelOptions = make_dataclass(
    "ModelOptions",
    [("name", str, field(default=MISSING))]
    + [
        (f.name, int | None, field(default=None))
        if f.name == "vocab_size"
        else (f.name, f.type, field(default=f.default))
        for f in fields(GPTConfig)
        if f.name not in ATTENTION_FIELDS
    ],
)


@dataclass
class AttentionOptions:
    name: Literal["sa", "xsa"] = MISSING  # sa: softmax attention | xsa: exclusive self attention
    eps: float = 1e-6  # added to ||v_i||^2 in XSA (fp32); GPTConfig checks it
    layers: Literal["all"] | int | list[int] = "all"  # the last N layers, or these 0-based layers: builders.xsa_layers
    gate: Literal["none", "tanh"] = knob("none")  # tanh: subtract tanh(alpha) x the projection, alpha per head


@dataclass
class DataOptions:
    """The keys of every data option: configs/data/_base.yaml's (preparation and loading) and the source; those of
    data=shakespeare and data=prepared."""

    dir: str | None = MISSING  # the token shards; null: under cache_dir
    cache_dir: str = MISSING  # where prepared shards go when dir is null
    val_split: Literal["auto", "document", "tail"] = MISSING  # whole documents, each one's end, or auto
    val_fraction: float | None = MISSING  # share held out; null: the paper's
    split_seed: int = MISSING  # seeds the document split's hash
    shard_documents: int = MISSING  # documents per shard
    prepare_workers: int = MISSING  # tokenizer processes
    tokenizer_documents: int = knob(ge=1)  # a trained BPE learns from the first N training documents
    block_size: int = knob(ge=1)  # training context (xsa-lm prepare: null, whole documents)
    val_windows: int | None = MISSING  # null: every validation window
    num_workers: int | Literal["auto"] = knob(ge=0, free=True)  # data-loader workers per device
    source: dict[str, Any] | None = MISSING  # a _target_ node: the source's own arguments; null (prepared): shards only


@dataclass
class LocalData(DataOptions):
    files: str | list[str] = MISSING  # a glob or a list of globs
    text_field: str = MISSING  # the text's key in .jsonl/.json records


@dataclass
class HFData(DataOptions):
    path: str = MISSING  # the hub dataset, ORG/NAME
    subset: str | None = MISSING  # its configuration name
    split: str = MISSING  # the split read
    text_field: str = MISSING  # the text's column
    data_files: str | list[str] | dict[str, Any] | None = MISSING  # datasets' data_files: a path, a list or a mapping
    max_documents: int | None = MISSING  # null: every document


@dataclass
class Partial:
    """A callable built with its arguments, called later with the rest (hydra.utils.instantiate's _partial_)."""

    _target_: str = MISSING  # what to build, by its import path
    _partial_: bool = MISSING  # true: built with these arguments, called later with the rest


@dataclass
class BPETokenizer(Partial):
    vocab_size: int = MISSING  # a trained BPE's vocabulary


@dataclass
class PathTokenizer(Partial):
    path: str | None = MISSING  # gpt2: null (the hub or its cache); file: required


@dataclass
class AdamWOptions(Partial):
    lr: float = knob(gt=0)  # peak LR
    betas: list[float] = knob(rule=_betas)  # AdamW's (beta1, beta2)
    eps: float = knob(gt=0)  # AdamW's epsilon
    weight_decay: float = knob(ge=0)  # matrices only


@dataclass
class WarmupCosineOptions(Partial):
    warmup_steps: int = knob(ge=0)  # linear warmup, then the cosine decay
    min_lr_ratio: float = knob(ge=0, le=1)  # the final LR over the peak
    total_steps: int | None = knob(ge=1, free=True)  # null: trainer.max_steps


@dataclass
class StrategyNode:
    """trainer.strategy as a _target_ node: the strategy's own arguments, checked where the node has them."""

    tensor_parallel_size: int = knob(1, rule=_one_only)  # ModelParallelStrategy's (trainer=fsdp)


@dataclass
class TrainerOptions:
    """lightning.Trainer's arguments (configs/trainer/default.yaml) and activation_checkpointing, which is ours."""

    _target_: str = MISSING  # xsa_lm.checkpoints.atomic.LinkingTrainer, a lightning.Trainer
    accelerator: str = field(default=MISSING, metadata=FREE)  # auto | cpu | gpu
    devices: int | str | list[int] = knob(rule=_devices, free=True)  # N | -1 | auto | device indices, per node
    strategy: str | StrategyNode = field(default=MISSING, metadata=FREE)  # auto | a name | a _target_ node
    num_nodes: int = knob(ge=1, free=True)  # nodes the run is launched on
    precision: str = MISSING  # auto (ours) or Lightning's name
    max_steps: int = knob(ge=1, free=True)  # optimizer steps
    gradient_clip_val: float | None = knob(ge=0)  # the gradient norm's bound; null: none
    log_every_n_steps: int = knob(ge=1, free=True)  # optimizer steps between logged rows
    limit_val_batches: int | float | None = MISSING  # null | N batches | a share: Lightning reads the type
    num_sanity_val_steps: int = MISSING  # validation batches before training
    enable_model_summary: bool = field(default=MISSING, metadata=FREE)  # Lightning's table of the model
    deterministic: bool | Literal["warn"] = MISSING  # torch's deterministic algorithms (warn: warn only)
    activation_checkpointing: bool = knob(free=True)  # recompute each block in the backward: the same values


@dataclass
class CSVLoggerOptions:
    _target_: str = MISSING  # <run dir>/metrics.csv


@dataclass
class WandbOptions:
    _target_: str = MISSING  # tracking.wandb_logger
    project: str = MISSING  # the W&B project
    entity: str | None = MISSING  # the W&B entity; null: the default
    group: str | None = MISSING  # runs of a group compare side by side
    job_type: str | None = MISSING  # e.g. lr-search, compare
    tags: list[str] = MISSING  # beside attention type and model preset
    mode: Literal["auto", "online", "offline", "disabled"] = MISSING  # auto: WANDB_MODE, else by the API key
    init_timeout_s: int = MISSING  # seconds wandb.init may take
    log_model: bool | Literal["all"] = MISSING  # checkpoints as W&B artifacts: at the end, or at each save (all)


@dataclass
class CSVLogger:
    csv: CSVLoggerOptions = MISSING  # <run dir>/metrics.csv


@dataclass
class WandbLogger(CSVLogger):
    wandb: WandbOptions = MISSING  # W&B


@dataclass
class NoLogger:
    pass


@dataclass
class CheckpointOptions:
    keep_last: int = knob(ge=0)  # step checkpoints kept besides last.ckpt and best.ckpt
    every_n_steps: int | None = knob(ge=1)  # null: at each validation
    async_save: bool = knob()  # sharded checkpoints written in the background


@dataclass
class FaultsOptions:
    skip_nonfinite_batches: int = knob(ge=0)  # steps with a NaN/inf gradient skipped before the run diverged
    spike_factor: float | None = knob(gt=0)  # loss / grad-norm over its running average logged as an event
    inject_nan_at_step: int | None = knob(ge=0)  # testing the recovery
    inject_nan_on_rank: int | None = knob(ge=0)  # null: every rank


@dataclass
class DiagnosticsOptions:
    every_n_steps: int | None = knob(ge=1)  # null: off
    sequences: int = knob(ge=1)  # the first N validation windows
    chunk: int = knob(ge=1)  # query positions per block when computing a_ii


@dataclass
class SamplesOptions:
    every_n_steps: int | None = knob(ge=1)  # null: off
    prompt: str = knob(rule=_text)  # empty: start from <|endoftext|>
    max_new_tokens: int = knob(ge=1)  # tokens per sample
    temperature: float = knob(ge=0)  # 0: greedy
    top_k: int | None = knob(ge=1)  # null: the whole vocabulary


@dataclass
class ProfileOptions:
    start_step: int | None = knob(ge=0)  # null: off
    steps: int = knob(ge=1)  # optimizer steps traced


@dataclass
class TrainOptions:
    """configs/train.yaml's own keys; the groups' nodes (model, data, ...) are typed by each option's schema."""

    seed: int = knob(ge=0, le=SEED_MAX)  # the data order, and the weights unless init_seed
    init_seed: int | None = knob(ge=0, le=SEED_MAX)  # null: weights from seed
    global_batch_tokens: int = knob(ge=1)  # tokens per optimizer step
    micro_batch_size: int = knob(ge=1, free=True)  # sequences per forward pass on one device (the split of a step)
    val_every_steps: int = knob(ge=1, free=True)  # optimizer steps between validations (and checkpoints)
    val_position_buckets: int = knob(ge=1, free=True)  # the validation loss per equal span of window positions
    compile: bool | Literal["auto"] = knob(free=True)  # auto: on CUDA runs
    sdpa_backends: str | list[str] = knob(rule=sdpa_backends_problem, free=True)  # auto | kernels: the same numbers
    reuse_host_memory: bool = knob(free=True)  # glibc: keep freed CPU memory (faster CPU steps)
    check_memory: bool = knob(free=True)  # refuse a run estimated not to fit
    resume: str | None = knob(rule=_resume, free=True)  # null | auto | a checkpoint path
    run_name: str | None = field(default=MISSING, metadata=FREE)  # null: derived from the run's settings
    progress_bar: bool = knob(free=True)  # optimizer steps with loss, tokens/s and time left
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions, metadata=FREE)
    faults: FaultsOptions = field(default_factory=FaultsOptions, metadata=FREE)
    diagnostics: DiagnosticsOptions = field(default_factory=DiagnosticsOptions, metadata=FREE)
    samples: SamplesOptions = field(default_factory=SamplesOptions, metadata=FREE)
    profile: ProfileOptions = field(default_factory=ProfileOptions, metadata=FREE)


GROUPS = ("model", "attention", "data", "tokenizer", "optim", "scheduler", "trainer", "logger")
# The schema check_values reads each group by: the keys every option of the group has.
GROUP_SCHEMAS = {
    "model": ModelOptions,
    "attention": AttentionOptions,
    "data": DataOptions,
    "optim": AdamWOptions,
    "scheduler": WarmupCosineOptions,
    "trainer": TrainerOptions,
}
# Keys beside the training config's in a composed config: Hydra's own, and those of the commands that compose it
# (configs/sweep.yaml, scale.yaml, plan.yaml; an experiment may set sweep and scale for them).
AROUND_TRAINING = ("hydra", "sweep", "scale", "device_memory_gb", "activation_checkpointing", "out", "overwrite")

# name in the config store -> schema; each option file names its own first in its defaults (`/<name>@_here_`).
SCHEMAS = {
    "_model_schema": ModelOptions,
    "_attention_schema": AttentionOptions,
    "_data_shakespeare_schema": DataOptions,
    "_data_local_schema": LocalData,
    "_data_hf_schema": HFData,
    "_data_prepared_schema": DataOptions,
    "_tokenizer_bpe_schema": BPETokenizer,
    "_tokenizer_path_schema": PathTokenizer,
    "_optim_adamw_schema": AdamWOptions,
    "_scheduler_warmup_cosine_schema": WarmupCosineOptions,
    "_trainer_schema": TrainerOptions,
    "_logger_csv_schema": CSVLogger,
    "_logger_wandb_schema": WandbLogger,
    "_logger_none_schema": NoLogger,
}
# Types OmegaConf holds as given (alone or `| None`); a union of others or a Literal it cannot.
OMEGACONF_TYPES = (int, float, bool, str, list[str])


def hydra_schema(schema: type) -> type:
    """The copy of a schema that Hydra's config store holds: the same keys and defaults, a checked field untyped (Hydra
    types a command-line value by its look: `max_steps=1.5` must reach its check, not stop in OmegaConf's words), as
    is a type OmegaConf cannot hold; a schema as its own copy."""
    own: list[tuple[str, Any, Any]] = []
    for f in fields(schema):
        if isinstance(f.type, type) and is_dataclass(f.type):
            own.append((f.name, node := hydra_schema(f.type), field(default_factory=node)))
            continue
        kinds = [kind for kind in options(f.type) if kind is not NoneType]
        held = len(kinds) == 1 and kinds[0] in OMEGACONF_TYPES and "check" not in f.metadata
        own.append((f.name, f.type if held else Any, field(default=f.default)))
    return make_dataclass(schema.__name__, own)


def register() -> None:
    """The schemas in Hydra's config store, outside the groups (so that no option of a group lists them). The root
    of train.yaml is untyped with typed nodes: sweep, scale and plan compose it and add keys of their own beside it,
    which a typed root would refuse (check_known_keys refuses the others)."""
    store = ConfigStore.instance()
    root = hydra_schema(TrainOptions)()
    store.store(name="_train_schema", node={f.name: getattr(root, f.name) for f in fields(root)})
    for name, schema in SCHEMAS.items():
        store.store(name=name, node=hydra_schema(schema))


def unknown_keys(node: DictConfig, prefix: str = "", known: list[str] | None = None) -> list[str]:
    """'key: not an option of ...' for each key of a typed node (and its typed nodes) that its schema lacks; `known`:
    the keys of an untyped node (the root of the training config)."""
    if known is None:
        schema = OmegaConf.get_type(node)
        if not is_dataclass(schema):
            return []
        known = [f.name for f in fields(schema)]
    where = prefix[:-1] or "configs/train.yaml"
    where = f"the {where} group" if where in GROUPS else where
    found = [
        f"{prefix}{key}: not an option of {where} (it has {', '.join(known)})"
        for key in map(str, node)
        if key not in known and (prefix or key not in AROUND_TRAINING)
    ]
    for key in known:
        if key in node and not OmegaConf.is_missing(node, key) and not OmegaConf.is_interpolation(node, key):
            child = node[key]  # a node, not `???`, an interpolation or a value
            found += unknown_keys(child, f"{prefix}{key}.") if isinstance(child, DictConfig) else []
    return found


def check_known_keys(cfg: DictConfig) -> None:
    """Keys no schema has, refused in one line: `+group.key=...` appends past the schema (Hydra opens the node for
    `+`), and the root of the training config is untyped (register). The first one is named."""
    unknown = unknown_keys(cfg, known=[f.name for f in fields(TrainOptions)] + list(GROUPS))
    if unknown:
        raise UserError(unknown[0])
