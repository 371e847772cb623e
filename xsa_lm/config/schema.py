"""Checked fields of the configs not yet typed by pydantic (configs/sweep.yaml's and scale.yaml's, read by
xsa_lm/sweep/settings.py): knob(ge=..., rule=...) on a dataclass field, checked by checks.py field_problems. The
training config is typed by config/spec.py."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

from omegaconf import MISSING

from xsa_lm.config.spec import SEED_MAX

__all__ = ["SEED_MAX", "Check", "Rule", "is_a", "knob", "options"]

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

    def type_problem(self, kinds: tuple[Any, ...], value: Any) -> str | None:
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


def knob(default: Any = MISSING, **check: Any) -> Any:
    """A checked field: Check's bounds or rule, e.g. knob(ge=1), knob(rule=...)."""
    return field(default=default, metadata={"check": Check(**check)})


def options(annotation: Any) -> tuple[Any, ...]:
    """The types a union annotation allows (`int | None` -> int, NoneType); a plain one alone."""
    return get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)


def is_a(kind: type, value: object) -> bool:
    if isinstance(value, bool):  # an int to Python, never a number here
        return kind is bool
    if kind is int:
        return isinstance(value, int)
    return kind is float and isinstance(value, int | float) and math.isfinite(value)
