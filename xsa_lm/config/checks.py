"""check_values: every value a user can set for `xsa-lm train` against its field in config/schema.py and the model
against GPTConfig's own check, before anything is built or written, in one line naming each bad value: Hydra types a
command-line value by its look, so `trainer.max_steps=1.5` or `seed=-1` compose fine and would fail deep inside torch
or Lightning, or worse, run."""

from collections.abc import Iterable
from dataclasses import Field, fields, is_dataclass

from omegaconf import DictConfig

from xsa_lm.config.schema import (
    GROUP_SCHEMAS,
    TrainOptions,
    check_known_keys,
    model_error,
    options,
)
from xsa_lm.errors import UserError
from xsa_lm.model.config import GPTConfig

GPT_FIELDS = {f.name for f in fields(GPTConfig)}


def field_problems(
    node: DictConfig | None, schema_fields: Iterable[Field], prefix: str = "", where_present: bool = False
) -> list[str]:
    """'key=value what it takes' for each checked field of the node's schema whose value in `node` is wrong, and 'key is
    missing' for each the node lacks (a check never goes unchecked), except in a node that takes several forms
    (trainer.strategy), whose keys are checked where present. `node` None: the config lacks the whole node."""
    bad = []
    for f in schema_fields:
        key, check = f"{prefix}{f.name}", f.metadata.get("check")
        schemas = [kind for kind in options(f.type) if isinstance(kind, type) and is_dataclass(kind)]
        present = node is not None and f.name in node
        value = node[f.name] if present and node is not None else None
        if schemas and (value is None or isinstance(value, DictConfig)):
            bad += field_problems(value, fields(schemas[0]), f"{key}.", where_present=f.type is not schemas[0])
        elif check and not present and not where_present:
            bad.append(f"{key} is missing from the config: set it")
        elif check and present:
            problem = check.problem(f.type, value)
            bad += [f"{key}={value} {problem}"] if problem else []
    return bad


def model_problem(cfg: DictConfig) -> list[str]:
    """GPTConfig's own check, the one range check of the model's fields, of the model group, attention.name and .eps,
    as far as the config has them (null: GPTConfig's default; attention.layers and .gate: builders.model_config)."""
    model, attention = cfg.get("model") or {}, cfg.get("attention") or {}
    given = {**model, "attention": attention.get("name"), "xsa_eps": attention.get("eps")}
    try:
        GPTConfig(**{key: value for key, value in given.items() if key in GPT_FIELDS and value is not None})
    except ValueError as e:
        return [str(model_error(e))]
    return []


def check_values(cfg: DictConfig) -> None:
    """Keys no schema has, then every checked field of the training config and its groups, and the model."""
    check_known_keys(cfg)
    bad = field_problems(cfg, fields(TrainOptions))
    for group, schema in GROUP_SCHEMAS.items():
        bad += field_problems(cfg.get(group), fields(schema), f"{group}.")
    bad += model_problem(cfg)
    if bad:
        raise UserError("; ".join(bad))


def check_switches(cfg: DictConfig, *, keys: Iterable[str]) -> None:
    """A command's own true-or-false options (the training config's are check_values'): a text such as `no` would
    count as true."""
    for key in keys:
        if not isinstance(cfg[key], bool):
            raise UserError(f"{key} must be true or false, got {cfg[key]!r}")
