"""Checks of config values read as DictConfig: field_problems for the knob() fields of config/schema.py (the sweep's
and scale's settings), check_switches for a command's true-or-false options, and check_values, the training config's
check by its spec, for the commands that compose it (plan, sweep, scale) until they take the spec."""

from collections.abc import Iterable
from dataclasses import Field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig

from xsa_lm.config.schema import options
from xsa_lm.config.spec import VALUES_ONLY, TrainSpec, parse
from xsa_lm.errors import UserError


def field_problems(
    node: DictConfig | None, schema_fields: Iterable[Field[Any]], prefix: str = "", where_present: bool = False
) -> list[str]:
    """'key=value what it takes' for each checked field of the node's schema whose value in `node` is wrong, and 'key is
    missing' for each the node lacks (a check never goes unchecked), except in a node that takes several forms,
    whose keys are checked where present. `node` None: the config lacks the whole node."""
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


def check_values(cfg: DictConfig) -> None:
    """Each value of the training config in a composed config, refused in one line naming each bad key
    (config/spec.py parse; not the rules across values, which depend on the devices a run has)."""
    parse(TrainSpec, cfg, context=VALUES_ONLY)


def check_switches(cfg: DictConfig, *, keys: Iterable[str]) -> None:
    """A command's own true-or-false options: a text such as `no` would count as true."""
    for key in keys:
        if not isinstance(cfg[key], bool):
            raise UserError(f"{key} must be true or false, got {cfg[key]!r}")
