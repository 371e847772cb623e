"""check_values: every value a user can set for `xsa-lm train` against its field in config/schema.py, before anything
is built or written, and the model's fields against GPTConfig's own check, in one line naming each bad value.

Hydra types a command-line value by its look (`1.5` is a float, `-1` an int), so `trainer.max_steps=1.5` or `seed=-1`
compose fine and would fail deep inside torch or Lightning, or worse, run.
"""

import dataclasses
import math
from dataclasses import fields, is_dataclass

from omegaconf import DictConfig

from xsa_lm.config.schema import (
    ATTENTION_FIELDS,
    GROUP_SCHEMAS,
    SEED_MAX,
    Check,
    Rule,
    TrainOptions,
    check_known_keys,
    model_error,
    options,
)
from xsa_lm.errors import UserError
from xsa_lm.model.config import GPTConfig

__all__ = ["SEED_MAX", "check_values"]


def field_problems(node: DictConfig | None, schema: type, prefix: str = "", where_present: bool = False) -> list[str]:
    """'key=value what it takes' for each checked field of `schema` whose value in `node` is wrong, and 'key is
    missing' for each the node lacks (a check never goes unchecked), except in a node that takes several forms
    (trainer.strategy), whose keys are checked where present. `node` None: the config lacks the whole node."""
    bad = []
    for f in fields(schema):
        key, check = f"{prefix}{f.name}", f.metadata.get("check")
        schemas = [kind for kind in options(f.type) if isinstance(kind, type) and is_dataclass(kind)]
        present = node is not None and f.name in node
        value = node[f.name] if present and node is not None else None
        if schemas and (value is None or isinstance(value, DictConfig)):
            bad += field_problems(value, schemas[0], f"{key}.", where_present=f.type is not schemas[0])
        elif check and not present and not where_present:
            bad.append(f"{key} is missing from the config: set it")
        elif check and present:
            problem = check.problem(f.type, value)
            bad += [f"{key}={value} {problem}"] if problem else []
    return bad


def model_problem(cfg: DictConfig) -> list[str]:
    """GPTConfig's own check, the one range check of the model's fields, of the model and attention groups as far as
    the config has them (attention.layers and .gate: builders.model_config)."""
    model, attention = cfg.get("model") or {}, cfg.get("attention") or {}
    given = {name: value for name, value in model.items() if name in GPTConfig.__dataclass_fields__}
    given |= {
        name: attention[key] for name, key in ATTENTION_FIELDS.items() if key in ("name", "eps") and key in attention
    }
    try:
        GPTConfig(
            **{name: value for name, value in given.items() if value is not None}
        )  # null vocab_size: the tokenizer's
    except ValueError as e:
        return [str(model_error(e))]
    return []


def check_values(cfg: DictConfig) -> None:
    """Keys no schema has, then every checked field of the training config and its groups, and the model."""
    check_known_keys(cfg)
    bad = field_problems(cfg, TrainOptions)
    for group, schema in GROUP_SCHEMAS.items():
        bad += field_problems(cfg.get(group), schema, f"{group}.")
    bad += model_problem(cfg)
    if bad:
        raise UserError("; ".join(bad))


# The rules sweep/settings.py builds on, as checks of a field of that type would make them.
def _int(minimum: int, maximum: int | None = None, nullable: bool = False) -> Rule:
    return lambda value: Check(ge=minimum, le=maximum).problem(int | None if nullable else int, value)


def _number(
    low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False, nullable=False
) -> Rule:
    top = high if high < math.inf else None
    bounds = Check(ge=None if low_open else low, gt=low if low_open else None)
    bounds = dataclasses.replace(bounds, le=None if high_open else top, lt=top if high_open else None)
    return lambda value: bounds.problem(float | None if nullable else float, value)


def _bool(value: object) -> str | None:
    return Check().problem(bool, value)
