"""Typed schemas of the training config: every key of configs/train.yaml and of each option of its groups. A renamed
or misspelt key in a file fails when Hydra composes the config, a key appended past a schema (`+optim.lrr=1`) when
the run starts (check_known_keys), each in one line from the CLI.

The files hold the values and say why; the schemas hold the keys and their types (`???`: the file sets it). A value
that a rule of checks.py checks is `Any` here: Hydra types a command-line value by its look, so an int
field would stop at `trainer.max_steps=1.5` in OmegaConf's words, where the rule names the key, the value and what
it takes, with every other bad value, in one line (and also checks a config.yaml read back on resume). The model
group mirrors GPTConfig (its presets list only what differs from it); its rules check ranges only.
"""

from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from xsa_lm.errors import UserError
from xsa_lm.model.config import GPTConfig

# GPTConfig fields that the attention group sets (attention.name, .eps, .layers, .gate), not the model group.
ATTENTION_FIELDS = ("attention", "xsa_eps", "xsa_layers", "xsa_gate")


def _model_fields() -> list[tuple]:
    """GPTConfig's architecture fields with its defaults, so the schema cannot drift from the model. vocab_size
    defaults to null: the tokenizer's vocabulary, padded (builders.py model_config)."""
    own: list[tuple[str, Any, Any]] = [("name", str, field(default=MISSING))]
    for f in fields(GPTConfig):
        if f.name == "vocab_size":
            own.append(("vocab_size", int | None, field(default=None)))
        elif f.name not in ATTENTION_FIELDS:
            own.append((f.name, f.type, field(default=f.default)))
    return own


ModelOptions = make_dataclass("ModelOptions", _model_fields())


@dataclass
class AttentionOptions:
    name: str = MISSING  # sa | xsa
    eps: float = 1e-6  # added to ||v_i||^2 in XSA (fp32)
    layers: Any = "all"  # all | N (the last N layers) | a list of 0-based layers: three types, so untyped
    gate: str = "none"  # none | tanh


@dataclass
class DataOptions:
    """configs/data/_base.yaml: preparation and loading, shared by every data option."""

    dir: str | None = MISSING
    cache_dir: str = MISSING
    val_split: str = MISSING  # auto | document | tail
    val_fraction: float | None = MISSING
    split_seed: int = MISSING
    shard_documents: int = MISSING
    prepare_workers: int = MISSING
    tokenizer_documents: int = MISSING
    block_size: Any = MISSING
    val_windows: int | None = MISSING
    num_workers: Any = MISSING  # auto | N


@dataclass
class ShakespeareData(DataOptions):
    source: Any = MISSING  # a _target_ node: the corpus's own arguments


@dataclass
class LocalData(DataOptions):
    files: Any = MISSING  # a glob or a list of globs
    text_field: str = MISSING
    source: Any = MISSING


@dataclass
class HFData(DataOptions):
    path: str = MISSING
    subset: str | None = MISSING
    split: str = MISSING
    text_field: str = MISSING
    data_files: Any = MISSING  # null, a path, a list or a split -> paths mapping (datasets' data_files)
    max_documents: int | None = MISSING
    source: Any = MISSING


@dataclass
class PreparedData(DataOptions):
    source: Any = MISSING  # null: the shards hold everything


@dataclass
class Partial:
    """A callable built with its arguments, called later with the rest (hydra.utils.instantiate's _partial_)."""

    _target_: str = MISSING
    _partial_: bool = MISSING


@dataclass
class BPETokenizer(Partial):
    vocab_size: int = MISSING


@dataclass
class PathTokenizer(Partial):
    path: str | None = MISSING  # gpt2: null (the hub or its cache); file: required


@dataclass
class AdamWOptions(Partial):
    lr: Any = MISSING
    betas: Any = MISSING
    eps: Any = MISSING
    weight_decay: Any = MISSING


@dataclass
class WarmupCosineOptions(Partial):
    warmup_steps: Any = MISSING
    min_lr_ratio: Any = MISSING
    total_steps: Any = MISSING


@dataclass
class TrainerOptions:
    """lightning.Trainer's arguments (configs/trainer/default.yaml) and activation_checkpointing, which is ours."""

    _target_: str = MISSING
    accelerator: str = MISSING
    devices: Any = MISSING  # N | auto | a list of device indices
    strategy: Any = MISSING  # auto | a _target_ node with the strategy's own arguments
    num_nodes: Any = MISSING
    precision: str = MISSING
    max_steps: Any = MISSING
    gradient_clip_val: Any = MISSING
    log_every_n_steps: Any = MISSING
    limit_val_batches: Any = MISSING  # null | N batches | a share (float): Lightning reads the type
    num_sanity_val_steps: int = MISSING
    enable_model_summary: bool = MISSING
    deterministic: Any = MISSING  # true | false | warn
    activation_checkpointing: Any = MISSING


@dataclass
class CSVLoggerOptions:
    _target_: str = MISSING


@dataclass
class WandbOptions:
    _target_: str = MISSING
    project: str = MISSING
    entity: str | None = MISSING
    group: str | None = MISSING
    job_type: str | None = MISSING
    tags: list[str] = MISSING
    mode: str = MISSING  # auto | online | offline | disabled
    init_timeout_s: int = MISSING
    log_model: Any = MISSING  # false | true | all


@dataclass
class CSVLogger:
    csv: CSVLoggerOptions = MISSING


@dataclass
class WandbLogger:
    csv: CSVLoggerOptions = MISSING
    wandb: WandbOptions = MISSING


@dataclass
class NoLogger:
    pass


@dataclass
class CheckpointOptions:
    keep_last: Any = MISSING
    every_n_steps: Any = MISSING
    async_save: Any = MISSING


@dataclass
class FaultsOptions:
    skip_nonfinite_batches: Any = MISSING
    spike_factor: Any = MISSING
    inject_nan_at_step: Any = MISSING
    inject_nan_on_rank: Any = MISSING


@dataclass
class DiagnosticsOptions:
    every_n_steps: Any = MISSING
    sequences: Any = MISSING
    chunk: Any = MISSING


@dataclass
class SamplesOptions:
    every_n_steps: Any = MISSING
    prompt: Any = MISSING  # typed `str`, OmegaConf would turn prompt=1e3 into "1000.0" silently; checks.py refuses it
    max_new_tokens: Any = MISSING
    temperature: Any = MISSING
    top_k: Any = MISSING


@dataclass
class ProfileOptions:
    start_step: Any = MISSING
    steps: Any = MISSING


@dataclass
class TrainOptions:
    """configs/train.yaml's own keys; the groups' nodes (model, data, ...) are typed by each option's schema."""

    seed: Any = MISSING
    init_seed: Any = MISSING
    global_batch_tokens: Any = MISSING
    micro_batch_size: Any = MISSING
    val_every_steps: Any = MISSING
    val_position_buckets: Any = MISSING
    compile: Any = MISSING  # auto | true | false
    sdpa_backends: Any = MISSING  # auto | a kernel | a list of kernels: OmegaConf types no str-or-list union
    reuse_host_memory: Any = MISSING
    check_memory: Any = MISSING
    resume: str | None = MISSING  # null | auto | a checkpoint path
    run_name: str | None = MISSING
    progress_bar: Any = MISSING
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    faults: FaultsOptions = field(default_factory=FaultsOptions)
    diagnostics: DiagnosticsOptions = field(default_factory=DiagnosticsOptions)
    samples: SamplesOptions = field(default_factory=SamplesOptions)
    profile: ProfileOptions = field(default_factory=ProfileOptions)


GROUPS = ("model", "attention", "data", "tokenizer", "optim", "scheduler", "trainer", "logger")
# Keys beside the training config's in a composed config: Hydra's own, and those of the commands that compose it
# (configs/sweep.yaml, scale.yaml, plan.yaml; an experiment may set sweep and scale for them).
AROUND_TRAINING = ("hydra", "sweep", "scale", "device_memory_gb", "activation_checkpointing", "out", "overwrite")

# name in the config store -> schema; each option file names its own first in its defaults (`/<name>@_here_`).
SCHEMAS = {
    "_model_schema": ModelOptions,
    "_attention_schema": AttentionOptions,
    "_data_shakespeare_schema": ShakespeareData,
    "_data_local_schema": LocalData,
    "_data_hf_schema": HFData,
    "_data_prepared_schema": PreparedData,
    "_tokenizer_bpe_schema": BPETokenizer,
    "_tokenizer_path_schema": PathTokenizer,
    "_optim_adamw_schema": AdamWOptions,
    "_scheduler_warmup_cosine_schema": WarmupCosineOptions,
    "_trainer_schema": TrainerOptions,
    "_logger_csv_schema": CSVLogger,
    "_logger_wandb_schema": WandbLogger,
    "_logger_none_schema": NoLogger,
}


def train_schema() -> dict:
    """TrainOptions as an untyped root with typed nodes: sweep, scale and plan compose configs/train.yaml and add
    keys of their own beside it, which a typed root would refuse (check_known_keys refuses the others)."""
    return {f.name: getattr(TrainOptions(), f.name) for f in fields(TrainOptions)}


def register() -> None:
    """The schemas in Hydra's config store, outside the groups (so that no option of a group lists them)."""
    store = ConfigStore.instance()
    store.store(name="_train_schema", node=train_schema())
    for name, schema in SCHEMAS.items():
        store.store(name=name, node=schema)


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """'key: not an option of ...' for each key of a typed node (and its typed nodes) that its schema lacks."""
    schema = OmegaConf.get_type(node)
    if not is_dataclass(schema):
        return []
    known = [f.name for f in fields(schema)]
    where = f"the {prefix[:-1]} group" if prefix[:-1] in GROUPS else prefix[:-1]
    found = [
        f"{prefix}{key}: not an option of {where} (it has {', '.join(known)})"
        for key in map(str, node)
        if key not in known
    ]
    for key in known:
        child = _node_at(node, key)
        if child is not None:
            found += unknown_keys(child, f"{prefix}{key}.")
    return found


def _node_at(node: DictConfig, key: str) -> DictConfig | None:
    """The node at `key`, if it holds one (not `???`, an interpolation or a value)."""
    if key not in node or OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
        return None
    child = node[key]
    return child if isinstance(child, DictConfig) else None


def check_known_keys(cfg: DictConfig) -> None:
    """Keys no schema has, refused in one line: `+group.key=...` appends past the schema (Hydra opens the node for
    `+`), and the root of the training config is untyped (train_schema). The first one is named."""
    own = [f.name for f in fields(TrainOptions)] + list(GROUPS)
    extra = [key for key in map(str, cfg) if key not in own and key not in AROUND_TRAINING]
    unknown = [f"{key}: not an option of configs/train.yaml (it has {', '.join(own)})" for key in extra]
    for key in own:
        child = _node_at(cfg, key)
        if child is not None:
            unknown += unknown_keys(child, f"{key}.")
    if unknown:
        raise UserError(unknown[0])
