"""The settings of `xsa-lm sweep` (configs/sweep/paper.yaml) and `xsa-lm scale` (configs/_scale.yaml), typed once:
frozen pydantic models whose fields own their type, range and one-line doc, converted from the composed config by
`parse` before the sweep or study directory gets anything. Hydra types a command-line value by its look
(`sweep.lrs=1e-3` is a number, not a list; `sweep.diverge_above=-1` a fine int), so every field is strict and a bad
value is refused in one line naming the key, the value and what it takes.
"""

import math
import shutil
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from xsa_lm.config.spec import SEED_MAX, rule
from xsa_lm.errors import UserError
from xsa_lm.sweep.protocol import check_search_seeds
from xsa_lm.sweep.stalls import StallRule

S = TypeVar("S", bound="Settings")


def plain(value: object) -> object:
    """A config list or dict as a Python one (anything else unchanged), also for messages."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def numbers_problem(value: Any, example: str, nullable: bool = False) -> str | None:
    """What is wrong with a list of distinct positive numbers ([] is left to the code that needs some)."""
    if value is None and nullable:
        return None
    if not isinstance(value, list) or any(not is_number(v) or v <= 0 for v in value):
        return f"must be a list of positive numbers, e.g. {example}" + (", or null" if nullable else "")
    twice = sorted(v for v, n in Counter(float(v) for v in value).items() if n > 1)
    return f"lists {', '.join(f'{v:g}' for v in twice)} twice: list each value once" if twice else None


def positive_numbers(example: str, nullable: bool = False) -> BeforeValidator:
    return rule(lambda value: numbers_problem(value, example, nullable))


def seed_list(nullable: bool = False) -> BeforeValidator:
    """Distinct seeds, each in the range `seed` takes."""

    def check(value: Any) -> str | None:
        if value is None and nullable:
            return None
        ints = isinstance(value, list) and all(type(s) is int and 0 <= s <= SEED_MAX for s in value)
        if not ints or len(set(value)) != len(value):
            return f"must be a list of distinct integers from 0 to {SEED_MAX}" + (", or null" if nullable else "")
        return None

    return rule(check)


def lr_range(value: Any) -> str | None:
    """{min, max, num}: num LRs log-spaced from min to max."""
    good = value is None or (
        isinstance(value, dict)
        and set(value) == {"min", "max", "num"}
        and is_number(value["min"])
        and is_number(value["max"])
        and 0 < value["min"] < value["max"]
        and type(value["num"]) is int
        and value["num"] >= 2
    )
    return None if good else "must be {min:..,max:..,num:..} with 0 < min < max and an integer num >= 2, or null"


def lr_grids(value: Any) -> str | None:
    """Model name -> its LR grid (a non-empty list of positive numbers)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "must map model names to LR lists, e.g. {tiny:[3e-3,1e-2,3e-2],default:[1e-4,3e-4]}"
    for name, lrs in value.items():
        problem = numbers_problem(lrs, "[1e-4,3e-4]") or (None if lrs else "must not be empty")
        if problem:
            return f"has {name!s}: {lrs}, which {problem}"
    return None


def stall(value: Any) -> str | None:
    """null, or the stall rule's keys (sweep/stalls.py StallRule checks their values)."""
    keys = {"at_fraction", "margin", "loss_threshold"}
    if value is None or (isinstance(value, dict) and set(value) <= keys):
        return None
    return f"must be null or hold only {', '.join(sorted(keys))}"


def command_prefix(value: Any) -> str | None:
    """The words put before each trial's command: [] (none), or a program found on PATH and its arguments."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or any(not isinstance(word, str) or not word for word in value):
        return "must be a list of words, e.g. [srun,--ntasks=1], or [] for none"
    if shutil.which(value[0]) is None:
        return f"starts with {value[0]}, which is no program on PATH (nor an executable file): install it or fix it"
    return None


def eval_tasks(value: Any) -> str | None:
    """null (no downstream evaluation), `paper`, a task name or YAML file, or a list of them."""
    words = value if isinstance(value, list) else [value]
    if value is None or (words and all(isinstance(w, str) and w for w in words)):
        return None
    return "must be null, paper, or a list of lm-eval task names or task YAML files"


class Settings(BaseModel):
    """A command's settings: frozen, no key beyond its fields, values of their own type."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class SweepSpec(Settings):
    """`xsa-lm sweep`'s settings (configs/sweep/paper.yaml says what each does)."""

    lrs: Annotated[list[float] | None, positive_numbers("[1e-3,3e-3]", nullable=True)]  # null: lr_range, lr_grids
    lr_range: Annotated[dict[str, float] | None, rule(lr_range)]  # {min, max, num}: log-spaced
    lr_grids: Annotated[dict[str, list[float]] | None, rule(lr_grids)]  # model name -> its grid
    search_seeds: Annotated[list[int], seed_list()]  # each LR scored by the median final loss over them
    seeds: Annotated[list[int] | None, seed_list(nullable=True)] = Field(description="[]: a search-only sweep")
    reuse_search_run: bool  # true: a search seed among the compare seeds (biased against XSA)
    seeds_until_significant: int | None  # add seed pairs until significant, up to this many (protocol.seed_sequence)
    margin: float = Field(
        ge=0, description="the practical margin in nats of XSA - SA, fixed in the plan before the runs"
    )
    null_arm: bool  # an A/A null beside the comparison
    tune_xsa: bool  # also grid-search XSA
    stall: Annotated[dict[str, float | None] | None, rule(stall)]  # when a search run stalls (sweep/stalls.py)
    diverge_above: float | None = Field(
        gt=0,
        allow_inf_nan=False,
        description="a final val loss above it counts as diverged; null: ln(vocabulary size), a uniform guess",
    )
    max_parallel: int = Field(ge=1)  # trials at once
    launch_prefix: Annotated[list[str] | None, rule(command_prefix)]  # put before each trial, e.g. [srun, --ntasks=1]
    wandb_report: bool  # a report run in the sweep's W&B group
    eval_tasks: Annotated[str | list[str] | None, rule(eval_tasks)]  # xsa-lm eval on the compare runs; null: none
    eval_limit: float | None = Field(gt=0, description="the first N examples per task; null: all")

    @model_validator(mode="after")
    def _search_seeds_and_stalls(self) -> "SweepSpec":
        """One search seed at least, and the stall rule's values (now, not at the report after every run). The
        compare seeds, which a scaling study sets per size, are the sweep's: check_sweep."""
        check_search_seeds(self.search_seeds)
        self.stall_rule  # noqa: B018
        return self

    @property
    def stall_rule(self) -> StallRule | None:
        """sweep.stall as a StallRule (None: no stall table)."""
        return StallRule(**self.stall) if self.stall else None  # type: ignore[arg-type]  # StallRule checks them


class ScaleSpec(Settings):
    """`xsa-lm scale`'s settings (configs/_scale.yaml says what each does)."""

    axis: Literal["size", "tokens"]  # the sizes at one token budget, or token budgets per size
    models: Any  # scale/run.py check_models: model presets, two or more on the size axis
    seeds: Annotated[list[int] | None, seed_list(nullable=True)] = Field(
        description="the compare seeds at every size; null: sweep.seeds"
    )
    fit: Literal["auto", "power_law_offset", "power_law"]  # scale/fit.py FORMS
    bootstrap_resamples: int = Field(ge=100)  # behind the bootstrap intervals
    bootstrap_seed: int = Field(ge=0, le=SEED_MAX)  # the same resamples on every rerun
    wandb_report: bool  # a scale-report run in the study's W&B group
    tokens_per_param: float = Field(gt=0)  # B = this x the non-embedding parameters
    sa_budgets: Annotated[list[float], positive_numbers("[0.5,1,2]")]  # in units of B
    xsa_budgets: Annotated[list[float], positive_numbers("[0.5,1]")]  # in units of B, within SA's
    lr_per_budget: bool  # SA's LR searched at every SA budget
    warmup_fraction: float | None = Field(
        ge=0, lt=1, description="the share of each run's steps spent warming up; null: the recipe's"
    )
    allow_repeated_data: bool  # false: a budget past one epoch is refused
    measure_throughput: bool  # xsa-lm bench SA vs XSA at each size
    bench_rounds: int = Field(ge=2)  # of the throughput bench
    bench: str | None  # scale/run.py load_bench: a results.json of `xsa-lm bench`

    @model_validator(mode="after")
    def _budgets(self) -> "ScaleSpec":
        """The token axis: SA at 2+ budgets including 1 (where the LR is chosen), XSA's inside SA's range, so that no
        multiplier needs an extrapolation."""
        sa, xsa = sorted(self.sa_budgets), sorted(self.xsa_budgets)
        if self.axis == "tokens" and (len(sa) < 2 or 1.0 not in sa):
            raise UserError(f"scale.sa_budgets needs 2+ positive budgets including 1 (the LR is chosen at B), got {sa}")
        if self.axis == "tokens" and (not xsa or any(not sa[0] <= f <= sa[-1] for f in xsa)):
            raise UserError(f"scale.xsa_budgets must lie within SA's budgets [{sa[0]:g}, {sa[-1]:g}], got {xsa}")
        return self


WANTED = {
    "int_type": "must be an integer",
    "float_type": "must be a finite number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "string_type": "must be text",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
}
BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def parse(spec_type: type[S], node: DictConfig | dict, group: str) -> S:
    """The settings of `group` (sweep or scale) as their spec, or a UserError of one line naming each bad key."""
    values = plain(node)
    try:
        return spec_type.model_validate(values)
    except ValidationError as e:
        raise UserError("; ".join(problems(spec_type, values, e.errors(), group))) from None


def problems(spec_type: type[Settings], values: Any, errors: Sequence[Mapping[str, Any]], group: str) -> list[str]:
    """Pydantic's errors as `group.key=value what it takes`, one per key."""
    said: dict[str, str] = {}
    for error in errors:
        name = str(error["loc"][0]) if error["loc"] else ""
        key = f"{group}.{name}"
        if key in said:
            continue
        if error["type"] == "extra_forbidden":
            said[key] = f"{key}: not a setting of `xsa-lm {group}` (it has {', '.join(spec_type.model_fields)})"
        elif error["type"] == "missing":
            said[key] = f"{key} is missing from the config: set it"
        elif not name:  # a rule across fields: its message names the keys
            said[key] = str(error["ctx"]["error"])
        else:
            said[key] = problem(spec_type, key, name, values.get(name), error)
    return list(said.values())


def problem(spec_type: type[Settings], key: str, name: str, value: Any, error: Mapping[str, Any]) -> str:
    """`key=value what it takes (what the setting does)` for one field's error."""
    kind, ctx, info = error["type"], error.get("ctx", {}), spec_type.model_fields[name]
    if kind == "literal_error":
        words = [w.strip("'") for w in ctx["expected"].replace(" or ", ", ").split(", ")]
        return f"{key}={value!r}: choose {', '.join(words[:-1])} or {words[-1]}"
    if kind == "value_error":
        text = str(ctx["error"])
    elif kind in BOUNDS:
        limit = next(iter(ctx.values()))
        text = f"must be {BOUNDS[kind]} {limit:g}" if isinstance(limit, float) else f"must be {BOUNDS[kind]} {limit}"
    else:
        text = WANTED.get(kind, error["msg"]) + (" or null" if value is None or "None" in str(info.annotation) else "")
    hint = f" ({info.description})" if info.description else ""
    return f"{key}={'null' if value is None else value} {text}{hint}"
