"""The training config typed once, as frozen pydantic models: a field owns its type, doc and range (a missing key is
refused, never filled in), rules across fields are model validators, derived values are computed once; `parse` turns
a bad config into ONE line naming each bad key. A field marked FREE may change on a resume (config/resume.py)."""

import importlib
import inspect
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, cached_property, partial
from importlib.resources import files
from typing import Annotated, Any, Literal, TypeVar, cast, get_args

from omegaconf import DictConfig, OmegaConf
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from xsa_lm.errors import UserError
from xsa_lm.model.config import BUILT_IN, GPTConfig
from xsa_lm.model.sdpa import config_problem as sdpa_backends_problem

SEED_MAX = 2**32 - 1  # numpy's seed range, which Lightning's seed_everything enforces
VOCAB_MULTIPLE = 64  # the embedding table padded: matmuls are faster on multiples of 64 (50257 -> 50304)
FREE: dict[str, Any] = {"free_on_resume": True}  # json_schema_extra of a key a resume may change
# Keys beside the training config's in a composed config: those of sweep (its launcher), scale and plan, which
# compose train.yaml.
AROUND_TRAINING = (
    "hydra",
    "sweep",
    "launcher",
    "scale",
    "device_memory_gb",
    "activation_checkpointing",
    "mfu",
    "out",
    "overwrite",
)
S = TypeVar("S", bound=BaseModel)
HYDRA_KEY = re.compile(r"_\w+_")  # instantiate's own keys (_args_, _partial_): not keyword arguments


def group_options(group: str) -> list[str]:
    """What `<group>=` selects: configs/<group>/*.yaml but a part the options share (_base.yaml)."""
    names = (p.name for p in files("xsa_lm.configs").joinpath(group).iterdir())
    return sorted(n.removesuffix(".yaml") for n in names if n.endswith(".yaml") and not n.startswith("_"))


class Spec(BaseModel):
    """A config node: frozen, no key beyond its fields, values of their own type (Hydra's `1.5` is no integer), every
    number finite (an infinite LR or margin trains or decides nothing)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, populate_by_name=True, allow_inf_nan=False)

    @property
    def node(self) -> dict[str, Any]:
        """The node as its file gives it (by `_target_`), for instantiate."""
        return self.model_dump(by_alias=True)


def rule(check: Any) -> BeforeValidator:
    """A field checked by a function of its own (value -> what is wrong with it, or None), before its type."""

    def validate(value: Any) -> Any:
        problem = check(value)
        if problem:
            raise ValueError(problem)
        return value

    return BeforeValidator(validate)


def _text(value: object) -> str | None:
    # Hydra types a value by its look: samples.prompt=1e3 arrives as 1000.0, =true as True.
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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _devices(value: Any) -> Any:
    """Lightning's forms: N > 0, -1 or auto (every device), a list of distinct indices, or either as text."""
    if isinstance(value, str) and value != "auto":
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if parts and all(p.lstrip("-").isdigit() for p in parts):
            value = [int(p) for p in parts] if "," in value else int(parts[0])
    indices = value if isinstance(value, list) else []
    if value == "auto" or value == -1 or (_is_int(value) and value >= 1):
        return value
    if indices and all(_is_int(i) and i >= 0 for i in indices) and len(set(indices)) == len(indices):
        return value
    raise ValueError(
        "must be a number of devices >= 1, -1 or auto (every device), or a list of distinct device indices"
    )


def _betas(value: Any) -> str | None:
    numbers = isinstance(value, list) and all(isinstance(b, int | float) and not isinstance(b, bool) for b in value)
    pair = numbers and len(value) == 2 and all(0 <= b < 1 for b in value)
    return None if pair else "must be two numbers in [0, 1), e.g. [0.9, 0.95]"


def _val_fraction(value: Any) -> str | None:
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 0.5):
        return None
    return (
        "must be in (0, 0.5]: it is the share held out for validation (nanoGPT's 90/10 split is data.val_fraction=0.1)"
    )


def flatten(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are values."""
    flat = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


Count = Annotated[int, Field(ge=1)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]


class ModelSpec(Spec):
    """The model group: GPTConfig's fields (GPTConfig checks them) and the preset's name."""

    name: str = Field(description="the preset, for run names and reports")
    n_layer: int = GPTConfig.n_layer
    d_model: int = GPTConfig.d_model
    n_head: int = GPTConfig.n_head
    head_dim: int = GPTConfig.head_dim
    vocab_size: int | None = None
    block_size: int = GPTConfig.block_size
    n_kv_head: Count | None = GPTConfig.n_kv_head
    n_sinks: int = GPTConfig.n_sinks
    mlp_ratio: int = GPTConfig.mlp_ratio
    bias: bool = GPTConfig.bias
    dropout: float = GPTConfig.dropout
    rope_base: float = GPTConfig.rope_base
    init_std: float = GPTConfig.init_std
    loss_chunk: int = GPTConfig.loss_chunk

    def gpt_config(self, attention: "AttentionSpec", vocab_size: int) -> GPTConfig:
        """GPTConfig of this group and `attention`; vocab_size null: the tokenizer's, padded to a multiple of 64."""
        architecture = self.model_dump(exclude={"name"})
        if architecture["vocab_size"] is None:
            architecture["vocab_size"] = math.ceil(vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        elif architecture["vocab_size"] < vocab_size:
            raise UserError(f"model.vocab_size={self.vocab_size} is smaller than the tokenizer's {vocab_size}")
        architecture.update(attention=attention.name, attention_target=attention.target)
        architecture["attention_options"] = attention.options
        try:
            return GPTConfig(**architecture)
        except ValueError as e:  # GPTConfig's refusal opens with its field: named by its config key
            name = str(e).split("=")[0].split(" ")[0]
            key = f"attention.{ATTENTION_FIELDS[name]}" if name in ATTENTION_FIELDS else f"model.{name}"
            key = name if name.startswith("attention.") else key  # a variant's option: GPTConfig.check_attention
            raise UserError(f"{key}{str(e)[len(name) :]}") from None


class AttentionSpec(Spec):
    """The attention group: a variant class by `_target_` (xsa_lm/model/attention.py says what one is), the option's
    name, and its other keys: the options the class is built with, checked by the class (GPTConfig.check_attention)."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True, populate_by_name=True)
    name: str = Field(description="the option's name: run names, sweep arms, reports")
    target: str = Field(alias="_target_", description="the variant's class, a CausalSelfAttention subclass")

    @model_validator(mode="before")
    @classmethod
    def _saved_before_targets(cls, node: Any) -> Any:
        """A run saved before the group named classes: a built-in by name, without the options its class lacks (sa
        kept XSA's eps, layers and gate)."""
        if not isinstance(node, dict) or "_target_" in node or "target" in node or node.get("name") not in BUILT_IN:
            return node
        target = BUILT_IN[node["name"]]
        taken = GPTConfig(attention=node["name"]).attention_class.option_names()
        return {"_target_": target, **{k: v for k, v in node.items() if k == "name" or k in taken}}

    @property
    def options(self) -> dict[str, Any]:
        """The variant's constructor arguments: every key but name and _target_."""
        return dict(self.model_extra or {})


class DataSpec(Spec):
    """configs/data/_base.yaml's keys (preparation and loading), each option's own, and the source node."""

    dir: str | None = Field(description="the token shards; null: <cache_dir>/<source>-<hash>")
    cache_dir: str = Field(description="where prepared shards go when dir is null")
    val_split: Literal["auto", "document", "tail"] = Field(description="whole documents or each one's end")
    val_fraction: Annotated[float | None, rule(_val_fraction)] = Field(description="share held out; null: the paper's")
    split_seed: int = Field(description="seeds the document split's hash")
    shard_documents: Count = Field(description="documents per shard")
    prepare_workers: Count = Field(description="tokenizer processes")
    tokenizer_documents: Count = Field(description="a trained BPE learns from the first N documents")
    block_size: Count | None = Field(description="training context (prepare: null, whole documents)")
    val_windows: Count | None = Field(description="null: every validation window")
    num_workers: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(json_schema_extra=FREE)
    source: dict[str, Any] | None = Field(description="a _target_ node (null: data=prepared, shards only)")
    files: str | list[str] | None = Field(None, description="data=local: a glob or a list of globs")
    text_field: str | None = Field(None, description="the text's key or column")
    path: str | None = Field(None, description="data=hf: the hub dataset, ORG/NAME")
    subset: str | None = Field(None, description="its configuration name")
    split: str | None = Field(None, description="the split read")
    data_files: str | list[str] | dict[str, Any] | None = Field(None, description="a builder's local files")
    max_documents: Count | None = Field(None, description="null: every document")


class TokenizerSpec(Spec):
    """A tokenizer option: a callable built with its arguments (_partial_), called with the training texts."""

    target: str = Field(alias="_target_", description="what builds it, by its import path")
    partial: bool = Field(True, alias="_partial_")
    vocab_size: Count | None = Field(None, description="bpe: the trained vocabulary")
    path: str | None = Field(None, description="gpt2: null (the hub) or a tokenizer.json; file: required")

    @property
    def node(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_unset=True)  # prepare.json records it as the file gave it


class OptimSpec(Spec):
    target: str = Field(alias="_target_")
    partial: bool = Field(True, alias="_partial_")
    lr: float = Field(gt=0, description="peak LR")
    betas: Annotated[list[float], rule(_betas)] = Field(description="AdamW's (beta1, beta2)")
    eps: float = Field(gt=0, description="AdamW's epsilon")
    weight_decay: float = Field(ge=0, description="matrices only")


class SchedulerSpec(Spec):
    target: str = Field(alias="_target_")
    partial: bool = Field(True, alias="_partial_")
    warmup_steps: int = Field(ge=0, description="linear warmup, then the cosine decay")
    min_lr_ratio: float = Field(ge=0, le=1, description="the final LR over the peak")
    total_steps: Count | None = Field(description="null: trainer.max_steps", json_schema_extra=FREE)


class TrainerSpec(Spec):
    """lightning.Trainer's arguments (configs/trainer/default.yaml) and activation_checkpointing, which is ours."""

    target: str = Field(alias="_target_")
    accelerator: str = Field(description="auto | cpu | gpu", json_schema_extra=FREE)
    devices: Annotated[int | Literal["auto"] | list[int], BeforeValidator(_devices)] = Field(json_schema_extra=FREE)
    strategy: str | dict[str, Any] = Field(description="auto | a name | a node", json_schema_extra=FREE)
    num_nodes: Count = Field(json_schema_extra=FREE)
    # auto (ours): bf16-mixed on GPUs with bf16, else 32-true; Lightning's 16, 32, 64 are names too
    precision: Annotated[str, BeforeValidator(lambda v: str(v) if _is_int(v) else v)]
    max_steps: Count = Field(description="optimizer steps", json_schema_extra=FREE)
    gradient_clip_val: float | None = Field(ge=0, description="the gradient norm's bound; null: none")
    log_every_n_steps: Count = Field(json_schema_extra=FREE)
    limit_val_batches: int | float | None = Field(description="null | N batches | a share")
    num_sanity_val_steps: int
    enable_model_summary: bool = Field(json_schema_extra=FREE)
    deterministic: bool | Literal["warn"]
    activation_checkpointing: bool = Field(description="recompute each block", json_schema_extra=FREE)

    @model_validator(mode="after")
    def _consistent(self) -> "TrainerSpec":
        if self.precision != "auto":  # a name Lightning accepts (auto asks the GPU: after set_device chose this rank's)
            self.resolved_precision  # noqa: B018
        # ModelParallelStrategy would build a tensor-parallel mesh that the model never uses: wrong, silently.
        size = self.strategy.get("tensor_parallel_size", 1) if isinstance(self.strategy, dict) else 1
        if size != 1 or isinstance(size, bool):
            raise ValueError(
                f"trainer.strategy.tensor_parallel_size={size} must be 1: tensor parallelism is not implemented "
                "(trainer=fsdp shards data parallel only)"
            )
        return self

    @property
    def strategy_kind(self) -> Literal["fsdp", "ddp"]:
        """`fsdp` for a sharding strategy (trainer=fsdp, or a strategy named so), else `ddp` (one device included)."""
        strategy = self.strategy
        target = str(strategy.get("_target_", "")) if isinstance(strategy, dict) else strategy
        return "fsdp" if "fsdp" in target.lower() or "ModelParallel" in target else "ddp"

    @cached_property
    def world_size(self) -> int:
        """Processes of the run: devices per node (auto/-1: the GPUs of a GPU run; on CPU one) x nodes."""
        if self.devices in ("auto", -1):
            import torch

            on_gpu = self.accelerator in ("auto", "gpu", "cuda")
            return ((torch.cuda.device_count() if on_gpu else 0) or 1) * self.num_nodes
        return (self.devices if isinstance(self.devices, int) else len(self.devices)) * self.num_nodes

    @cached_property
    def resolved_precision(self) -> str:
        """trainer.precision by Lightning's name (`16` is `16-mixed`); auto: bf16-mixed on a GPU with bf16."""
        import torch

        from xsa_lm.compat import PRECISIONS, lightning_precision_name

        if self.precision == "auto":
            on_gpu = self.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
            return "bf16-mixed" if on_gpu and torch.cuda.is_bf16_supported() else "32-true"
        try:
            return lightning_precision_name(self.precision)
        except ValueError:
            raise UserError(
                f"trainer.precision={self.precision} is not a precision Lightning accepts: use auto or one of "
                f"{', '.join(PRECISIONS)}"
            ) from None


class WandbSpec(Spec):
    target: str = Field(alias="_target_")
    project: str
    entity: str | None
    group: str | None = Field(description="runs of a group compare side by side")
    job_type: str | None = Field(description="e.g. lr-search, compare")
    tags: list[str] = Field(description="beside attention type and model preset")
    mode: Literal["auto", "online", "offline", "disabled"] = Field(description="auto: WANDB_MODE, else by the API key")
    init_timeout_s: int = Field(ge=1)
    log_model: bool | Literal["all"] = Field(description="checkpoints as W&B artifacts (all: each save)")


def _lab_class(value: object, base: str) -> str | None:
    """What is wrong with a lab's `_target_`: not importable, or not a subclass of Lightning's `base` class."""
    if not isinstance(value, str):
        return None  # its type is told by the field
    (module, _, name), (base_module, _, base_name) = value.rpartition("."), base.rpartition(".")
    if not module:
        return f"must name a class by its module, e.g. my_pkg.My{base_name}"
    try:
        found = getattr(importlib.import_module(module), name)
    except Exception as e:  # whatever its import raised, in one line (hydra's get_object would also log it)
        cause = (str(e).splitlines() or [type(e).__name__])[0]
        return f"cannot be imported ({cause}): put its package on PYTHONPATH or pip install it"
    expected = getattr(importlib.import_module(base_module), base_name)  # Lightning: only such a config imports it
    if not (isinstance(found, type) and issubclass(found, expected)):
        return f"is not a Lightning {base_name} class ({base})"
    return None


class LabPart(Spec):
    """A lab's own Lightning callback or logger: a class by `_target_`, its other keys the arguments it takes."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True, populate_by_name=True)
    target: str = Field(alias="_target_")


class CallbackSpec(LabPart):
    target: Annotated[str, rule(partial(_lab_class, base="lightning.pytorch.callbacks.Callback"))] = Field(
        alias="_target_", description="a Lightning Callback class"
    )


class LabLoggerSpec(LabPart):
    target: Annotated[str, rule(partial(_lab_class, base="lightning.pytorch.loggers.Logger"))] = Field(
        alias="_target_", description="a Lightning Logger class"
    )


def check_arguments(parts: Mapping[str, LabPart], at: str) -> None:
    """Each part's keys bound to its class's constructor, so that a wrong one is refused before the run folder."""
    for name, part in parts.items():
        module, _, cls = part.target.rpartition(".")
        signature = inspect.signature(getattr(importlib.import_module(module), cls))
        given = part.model_extra or {}
        arguments = {k: v for k, v in given.items() if not HYDRA_KEY.fullmatch(k)}
        try:
            signature.bind(*given.get("_args_", []), **arguments)
        except TypeError as e:
            takes = signature.replace(return_annotation=inspect.Signature.empty)
            raise ValueError(f"{at}{name} cannot build {part.target}{takes}: {e}") from None


class LoggerSpec(Spec):
    """metrics.csv, W&B, and a lab's own loggers by name (any other key), after them."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=True, populate_by_name=True)
    __pydantic_extra__: dict[str, LabLoggerSpec] = Field(init=False)
    csv: dict[str, Any] | None = Field(None, description="metrics.csv: a _target_ node")
    wandb: WandbSpec | None = None

    @model_validator(mode="after")
    def _arguments(self) -> "LoggerSpec":
        check_arguments(self.labs, at="logger.")
        return self

    @property
    def labs(self) -> dict[str, LabLoggerSpec]:
        """A lab's own loggers, by name."""
        return dict(self.model_extra or {})


class CheckpointSpec(Spec):
    keep_last: int = Field(ge=0, description="step checkpoints kept besides last.ckpt and best.ckpt")
    every_n_steps: Count | None = Field(description="null: at each validation")
    async_save: bool = Field(description="sharded checkpoints written in the background")


class FaultsSpec(Spec):
    skip_nonfinite_batches: int = Field(ge=0, description="NaN/inf steps skipped before the run diverged")
    spike_factor: float | None = Field(gt=0, description="loss or grad-norm over its average: an event")
    inject_nan_at_step: int | None = Field(ge=0, description="testing the recovery")
    inject_nan_on_rank: int | None = Field(ge=0, description="null: every rank")

    @model_validator(mode="after")
    def _rank_of_an_injection(self) -> "FaultsSpec":
        if self.inject_nan_on_rank is not None and self.inject_nan_at_step is None:
            raise ValueError(
                f"faults.inject_nan_on_rank={self.inject_nan_on_rank} would do nothing: it picks the rank of "
                "faults.inject_nan_at_step, which is null; set both, or neither"
            )
        return self


class DiagnosticsSpec(Spec):
    every_n_steps: Count | None = Field(description="null: off")
    sequences: Count = Field(description="the first N validation windows")
    chunk: Count = Field(description="query positions per block when computing a_ii")


class SamplesSpec(Spec):
    every_n_steps: Count | None = Field(description="null: off")
    prompt: Annotated[str, rule(_text)] = Field(description="empty: start from <|endoftext|>")
    max_new_tokens: Count
    temperature: float = Field(ge=0, description="0: greedy")
    top_k: Count | None = Field(description="null: the whole vocabulary")


class ProfileSpec(Spec):
    start_step: int | None = Field(ge=0, description="null: off")
    steps: Count = Field(description="optimizer steps traced")


SWITCHED_ON_BY = {"diagnostics": "every_n_steps", "samples": "every_n_steps", "profile": "start_step"}  # null: off


class PrepareSpec(Spec):
    """configs/prepare.yaml: `xsa-lm prepare`'s data and tokenizer."""

    data: DataSpec
    tokenizer: TokenizerSpec
    progress_bar: bool = Field(description="documents, tokens/s and ETA")


@dataclass(frozen=True)
class Schedule:
    """The LR schedule as the run settles it: its length, its warmup (clipped to the length) and the warning."""

    total_steps: int
    warmup_steps: int
    warning: str | None


class TrainSpec(Spec):
    """configs/train.yaml: the run's own keys and each group's node."""

    seed: Seed = Field(description="the data order, and the weights unless init_seed")
    init_seed: Seed | None = Field(description="null: weights from seed")
    init_perturbation: float = Field(default=0.0, ge=0, description="w += this x rms(w) x N(0,1): the placebo arm")
    global_batch_tokens: Count = Field(description="tokens per optimizer step")
    micro_batch_size: Count = Field(description="sequences per forward on one device", json_schema_extra=FREE)
    val_every_steps: Count = Field(description="steps between validations", json_schema_extra=FREE)
    val_position_buckets: Count = Field(description="val loss per span of positions", json_schema_extra=FREE)
    compile: bool | Literal["auto"] = Field(description="auto: on CUDA runs", json_schema_extra=FREE)
    sdpa_backends: Annotated[str | list[str], rule(sdpa_backends_problem)] = Field(json_schema_extra=FREE)
    reuse_host_memory: bool = Field(description="keep freed CPU memory", json_schema_extra=FREE)
    check_memory: bool = Field(description="refuse a run estimated not to fit", json_schema_extra=FREE)
    resume: Annotated[str | None, rule(_resume)] = Field(json_schema_extra=FREE)
    run_name: str | None = Field(description="null: run_label", json_schema_extra=FREE)
    progress_bar: bool = Field(json_schema_extra=FREE)
    checkpoint: CheckpointSpec = Field(json_schema_extra=FREE)
    faults: FaultsSpec = Field(json_schema_extra=FREE)
    diagnostics: DiagnosticsSpec = Field(json_schema_extra=FREE)
    samples: SamplesSpec = Field(json_schema_extra=FREE)
    profile: ProfileSpec = Field(json_schema_extra=FREE)
    model: ModelSpec
    attention: AttentionSpec
    data: DataSpec
    tokenizer: TokenizerSpec
    optim: OptimSpec
    scheduler: SchedulerSpec
    trainer: TrainerSpec
    logger: LoggerSpec = Field(json_schema_extra=FREE)
    callbacks: dict[str, CallbackSpec] = Field(  # the one key filled in: a run saved before the group had none
        default_factory=dict, description="a lab's own, after the built-in ones", json_schema_extra=FREE
    )

    @field_validator("callbacks")
    @classmethod
    def _callback_arguments(cls, callbacks: dict[str, CallbackSpec]) -> dict[str, CallbackSpec]:
        check_arguments(callbacks, at="callbacks.")
        return callbacks

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "TrainSpec":
        self.gpt_config(vocab_size=1)  # GPTConfig's own check and its attention variant's, before the data is prepared
        if info.context == VALUES_ONLY:
            return self
        block = self.block_size
        if block > self.model.block_size:
            raise ValueError(
                f"data.block_size={block} is above model.block_size={self.model.block_size}: "
                "lower data.block_size or raise model.block_size"
            )
        if self.val_position_buckets > block:  # spans without a position would be reported empty
            raise ValueError(
                f"val_position_buckets={self.val_position_buckets} is above data.block_size={block}: "
                "each span needs a position; lower it"
            )
        devices, per_micro_step = self.trainer.world_size, self.micro_batch_size * self.trainer.world_size * block
        if self.global_batch_tokens % per_micro_step:
            raise ValueError(
                f"global_batch_tokens={self.global_batch_tokens} is not divisible by micro_batch_size x devices x "
                f"data.block_size = {self.micro_batch_size} x {devices} x {block} = {per_micro_step}: "
                "choose a multiple"
            )
        sharded = self.trainer.strategy_kind == "fsdp"
        for group, every in (("diagnostics", self.diagnostics.every_n_steps), ("samples", self.samples.every_n_steps)):
            if sharded and every:  # they run a forward on rank 0 alone: under sharding it would hang
                raise ValueError(
                    f"{group}.every_n_steps: not available under trainer=fsdp; run `xsa-lm analyze` or "
                    "`xsa-lm generate` on its checkpoints instead"
                )
        strategy = self.trainer.strategy
        sharded_files = sharded and isinstance(strategy, dict) and strategy.get("save_distributed_checkpoint", True)
        if self.checkpoint.async_save and not sharded_files:
            raise ValueError(
                "checkpoint.async_save=true: only for sharded checkpoints (trainer=fsdp with "
                "trainer.strategy.save_distributed_checkpoint=true); leave it false here"
            )
        rank = self.faults.inject_nan_on_rank
        if self.faults.inject_nan_at_step is not None and rank is not None and rank >= devices:
            raise ValueError(
                f"faults.inject_nan_on_rank={rank}: this run has {devices} device(s), ranks 0 to {devices - 1}; "
                "the NaN would never be injected"
            )
        start, steps = self.profile.start_step, self.profile.steps
        if start is not None and start + steps > self.trainer.max_steps:
            raise ValueError(
                f"profile.start_step={start} + profile.steps={steps} is beyond trainer.max_steps="
                f"{self.trainer.max_steps}: the trace would be cut short or never start; profile earlier steps"
            )
        return self

    def refuse_idle_options(self, overrides: list[str]) -> None:
        """An option of a switched-off group (SWITCHED_ON_BY) given on the command line would do nothing: refused."""
        for override in overrides:
            group, _, key = override.split("=", 1)[0].lstrip("~+").partition(".")
            switch = SWITCHED_ON_BY.get(group)
            if switch is not None and key not in ("", switch) and getattr(getattr(self, group), switch) is None:
                raise UserError(
                    f"{override}: {group}.{key} acts only when {group}.{switch} is set, and it is null (off): "
                    f"set {group}.{switch}=N too, or leave it out"
                )

    @property
    def block_size(self) -> int:
        """The training context: data.block_size (null: model.block_size)."""
        return self.data.block_size or self.model.block_size

    @property
    def accumulate(self) -> int:
        """Micro-batches per optimizer step on each device."""
        return self.global_batch_tokens // (self.micro_batch_size * self.trainer.world_size * self.block_size)

    @cached_property
    def schedule(self) -> Schedule:
        """The LR schedule's length (null: trainer.max_steps) and warmup, clipped to it with a warning."""
        max_steps = self.trainer.max_steps
        total, warmup = self.scheduler.total_steps or max_steps, self.scheduler.warmup_steps
        if warmup <= total:
            return Schedule(total, warmup, None)
        extra, lr = max_steps - total, self.optim.lr
        final = lr * self.scheduler.min_lr_ratio
        after = f" (the {extra} steps after it run at its final LR {final:g})" if extra > 0 else ""
        warning = (
            f"WARNING: scheduler.warmup_steps={warmup} is longer than the LR schedule's {total} steps "
            f"(scheduler.total_steps, default trainer.max_steps): clipped to {total}, so the LR reaches optim.lr="
            f"{lr:g} at the schedule's last step{after}; set scheduler.warmup_steps below {total} to have a "
            "decay after it"
        )
        return Schedule(total, total, warning)

    @property
    def scheduler_node(self) -> dict[str, Any]:
        """The scheduler as instantiate builds it, its length and warmup settled."""
        settled = {"total_steps": self.schedule.total_steps, "warmup_steps": self.schedule.warmup_steps}
        return {**self.scheduler.model_dump(by_alias=True), **settled}

    @property
    def run_label(self) -> str:
        """The W&B run name: run_name, or <attention>-<model>-lr<lr>-s<seed>."""
        return self.run_name or f"{self.attention.name}-{self.model.name}-lr{self.optim.lr:g}-s{self.seed}"

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """GPTConfig of this run's model and attention for a tokenizer of `vocab_size` tokens."""
        return self.model.gpt_config(self.attention, vocab_size)


# GPTConfig fields that the attention group sets, by their key there (its options: attention.<option>).
ATTENTION_FIELDS = {"attention": "name", "attention_target": "_target_"}


@cache
def all_fields(spec_type: type[BaseModel] = TrainSpec) -> dict[str, FieldInfo]:
    """Every key of a spec by its dotted name (`trainer.max_steps`), nodes too, with its field."""
    found: dict[str, FieldInfo] = {}
    for name, info in spec_type.model_fields.items():
        key, inner = info.alias or name, nested_model(info.annotation)
        found[key] = info
        found.update({f"{key}.{k}": v for k, v in (all_fields(inner) if inner else {}).items()})
    return found


@cache
def is_free(key: str) -> bool:
    """Whether a resume may change the key: a field marked FREE, or any key inside a node marked so."""
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        info = all_fields().get(".".join(parts[:i]))
        if info is not None and info.json_schema_extra == FREE and (i == len(parts) or nested_model(info.annotation)):
            return True
    return False


Error = Mapping[str, Any]  # one of pydantic's errors (type, loc, msg, ctx)
VALUES_ONLY = "values only"  # parse's context: each value checked, not the rules across them (the batch arithmetic)
WANTED = {
    **dict.fromkeys(("int_type", "int_from_float"), "must be an integer"),
    **dict.fromkeys(("float_type", "finite_number"), "must be a finite number"),
    **dict.fromkeys(("dict_type", "model_type"), "must be a mapping"),
    **{"bool_type": "must be true or false", "string_type": "must be text", "list_type": "must be a list"},
}
BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
GROUPS = ("model", "attention", "data", "tokenizer", "optim", "scheduler", "trainer", "logger", "callbacks")


def parse(spec_type: type[S], cfg: DictConfig | Mapping[str, Any], context: str | None = None, at: str = "") -> S:
    """The model of a config node, or one line naming each bad key by its full name (`at`: the node's, e.g. `sweep.`):
    `trainer.max_steps=1.5 must be an integer`. A TrainSpec leaves the keys around training aside."""
    if isinstance(cfg, DictConfig):
        if spec_type is TrainSpec:  # Hydra's node resolves only inside a job
            cfg = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k not in AROUND_TRAINING])
        require_values(cast(dict[str, Any], OmegaConf.to_container(cfg)), at)  # `???`, also behind an interpolation
        cfg = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    values = {str(k): v for k, v in cfg.items() if spec_type is not TrainSpec or k not in AROUND_TRAINING}
    require_values(values, at)
    try:
        return spec_type.model_validate(values, context=context)
    except ValidationError as e:
        by_key: dict[str, list[Error]] = {}
        for error in e.errors():
            by_key.setdefault(key_of(error["loc"], values), []).append(error)
        lines = [problem(spec_type, key, errors, values, at) for key, errors in by_key.items()]
        raise UserError("; ".join(lines)) from None


def require_values(config: dict[str, Any], at: str = "") -> None:
    """A `???` value left unset is refused, naming each."""
    missing = [at + k for k, v in flatten(config).items() if v == "???"]
    if missing:
        raise UserError(
            f"missing required value(s): {', '.join(missing)}; set them on the command line, e.g. {missing[0]}=..."
        )


def key_of(loc: tuple[int | str, ...], values: dict[str, Any]) -> str:
    """The key an error is about: its location's steps into the mappings of `values`."""
    parts, node = [], cast(Any, values)
    for part in loc:
        if not isinstance(node, dict):
            break
        parts.append(str(part))
        node = node.get(str(part))
    return ".".join(parts)


def nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (alone or `| None`), if any."""
    kinds = [k for k in (annotation, *get_args(annotation)) if isinstance(k, type) and issubclass(k, BaseModel)]
    return kinds[0] if kinds else None


def problem(spec_type: type[BaseModel], key: str, errors: Sequence[Error], values: dict[str, Any], at: str) -> str:
    """`key=value what it takes`; the alternatives of a union joined; a rule across fields: its own message."""
    first, (node, _, name) = errors[0], key.rpartition(".")
    siblings = {k.rpartition(".")[2]: v for k, v in all_fields(spec_type).items() if k.rpartition(".")[0] == node}
    if first["type"] == "extra_forbidden":
        where = f"{at}{node}".strip(".")
        where = f"the {where} group" if where in GROUPS else where or "configs/train.yaml"
        return f"{at}{key}: not an option of {where} (it has {', '.join(siblings)})"
    if first["type"] == "missing":
        return f"{at}{key} is missing from the config: set it"
    if first["type"] == "value_error" and not key:
        return str(first["ctx"]["error"])
    value: Any = values
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    words = [w.strip("'") for e in errors if e["type"] == "literal_error" for w in e["ctx"]["expected"].split(", ")]
    words = [w for word in words for w in word.replace("' or '", "|").split("|")]
    said = list(dict.fromkeys(what(e) for e in errors if e["type"] != "literal_error"))
    field = siblings.get(name)
    if first["type"] == "value_error":
        text = said[0]
    elif said == [WANTED["bool_type"]] and words:  # a switch with words of its own (compile: auto)
        text = f"must be true, false or {', '.join(words)}"
    elif said:
        text = " or ".join(said) + (f" or {', '.join(words)}" if words else "")
        nullable = field is not None and type(None) in get_args(field.annotation)
        text += " or null" if nullable and first["type"] in WANTED else ""
    else:
        text = f"must be one of {', '.join(words)}"
    if first["type"] == "value_error" and text.startswith(key):
        return text
    return f"{at}{key}={'null' if value is None else value} {text}"


def what(error: Error) -> str:
    """What one pydantic error says the value must be."""
    kind, ctx = error["type"], error.get("ctx", {})
    if kind == "value_error":
        return str(ctx["error"])
    if kind in BOUNDS:
        limit = next(iter(ctx.values()))
        return f"must be {BOUNDS[kind]} {limit:g}" if isinstance(limit, float) else f"must be {BOUNDS[kind]} {limit}"
    return WANTED.get(kind, str(error["msg"]))
