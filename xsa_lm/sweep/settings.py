"""The type and range of every setting of `xsa-lm sweep` (configs/sweep/paper.yaml) and `xsa-lm scale`
(configs/_scale.yaml), checked before the sweep or study directory gets anything.

Hydra types a command-line value by its look: `sweep.lrs=1e-3` is a number, not a list, `sweep.seeds=[a,b]` a list of
strings, and `sweep.diverge_above=-1` a fine int. Each would fail halfway through a sweep, or worse, run: with a bound
of -1 every run "diverged". The rules that tie settings together (compare seeds apart from the search seeds, a cap
above the seeds, budgets within each other) stay with the code that uses them (protocol.py, scale/); these come
first, so that those see the types they expect.
"""

import math
import shutil
from collections import Counter
from collections.abc import Callable

from omegaconf import DictConfig, ListConfig, OmegaConf

from xsa_lm.config.checks import SEED_MAX, _bool, _int, _number
from xsa_lm.errors import UserError

Rule = Callable[[object], str | None]  # a value -> what is wrong with it (None: nothing)


def plain(value: object) -> object:
    """A config list or dict as a Python one (anything else unchanged), also for messages."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def is_list(value: object) -> bool:
    return isinstance(value, list | tuple | ListConfig)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def positive_numbers(example: str, nullable: bool = False) -> Rule:
    """A list of distinct positive numbers ([] is left to the code that needs some, which says why)."""

    def check(value) -> str | None:
        if value is None and nullable:
            return None
        if not is_list(value) or any(not is_number(v) or v <= 0 for v in value):
            return f"must be a list of positive numbers, e.g. {example}" + (", or null" if nullable else "")
        twice = sorted(v for v, n in Counter(float(v) for v in value).items() if n > 1)
        return f"lists {', '.join(f'{v:g}' for v in twice)} twice: list each value once" if twice else None

    return check


def seed_list(nullable: bool = False) -> Rule:
    """Distinct seeds, each in the range `seed` takes (numpy's, which Lightning's seed_everything enforces)."""

    def check(value) -> str | None:
        if value is None and nullable:
            return None
        ints = is_list(value) and all(_int(0, SEED_MAX)(s) is None for s in value)
        if not ints or len(set(value)) != len(value):
            return f"must be a list of distinct integers from 0 to {SEED_MAX}" + (", or null" if nullable else "")
        return None

    return check


def lr_range(value) -> str | None:
    """null, or {min, max, num}: num LRs log-spaced from min to max."""
    if value is None:
        return None
    good = (
        isinstance(value, dict | DictConfig)
        and set(value) == {"min", "max", "num"}
        and is_number(value["min"])
        and is_number(value["max"])
        and 0 < value["min"] < value["max"]
        and _int(2)(value["num"]) is None
    )
    return None if good else "must be {min:..,max:..,num:..} with 0 < min < max and an integer num >= 2, or null"


def lr_grids(value) -> str | None:
    """null, or model name -> its LR grid (a non-empty list of positive numbers)."""
    if value is None:
        return None
    if not isinstance(value, dict | DictConfig):
        return "must map model names to LR lists, e.g. {tiny:[3e-3,1e-2,3e-2],default:[1e-4,3e-4]}"
    grid = positive_numbers("[1e-4,3e-4]")
    for name, lrs in value.items():
        problem = grid(lrs) or (None if not is_list(lrs) or len(lrs) else "must not be empty")
        if problem:
            return f"has {name!s}: {plain(lrs)}, which {problem}"
    return None


def stall(value) -> str | None:
    """null, or the stall rule's keys (sweep/stalls.py StallRule checks their values)."""
    keys = {"at_fraction", "margin", "loss_threshold"}
    if value is None or (isinstance(value, dict | DictConfig) and set(value) <= keys):
        return None
    return f"must be null or hold only {', '.join(sorted(keys))}"


def command_prefix(value) -> str | None:
    """The words put before each trial's command: [] (none), or a program found on PATH and its arguments."""
    if value is None or (is_list(value) and not value):
        return None
    if not is_list(value) or any(not isinstance(word, str) or not word for word in value):
        return "must be a list of words, e.g. [srun,--ntasks=1], or [] for none"
    if shutil.which(value[0]) is None:
        return f"starts with {value[0]}, which is no program on PATH (nor an executable file): install it or fix it"
    return None


def eval_tasks(value) -> str | None:
    """null (no downstream evaluation), `paper`, a task name or YAML file, or a list of them."""
    words = list(value) if is_list(value) else [value]
    if value is None or (words and all(isinstance(w, str) and w for w in words)):
        return None
    return "must be null, paper, or a list of lm-eval task names or task YAML files"


def checked_elsewhere(value) -> None:
    """A setting whose rule needs other settings: the code that uses it checks it, before anything is written."""
    return None


def choice(*options: str) -> Rule:
    def check(value) -> str | None:
        return None if value in options else f"must be one of {', '.join(options)}"

    return check


def hinted(rule: Rule, hint: str) -> Rule:
    """A rule whose refusal also says what the setting does."""

    def check(value) -> str | None:
        problem = rule(value)
        return f"{problem} ({hint})" if problem else None

    return check


SWEEP_RULES: dict[str, Rule] = {
    "lrs": positive_numbers("[1e-3,3e-3]", nullable=True),
    "lr_range": lr_range,
    "lr_grids": lr_grids,
    "search_seeds": seed_list(),
    "seeds": hinted(seed_list(nullable=True), "[]: a search-only sweep"),
    "reuse_search_run": _bool,
    "seeds_until_significant": checked_elsewhere,  # protocol.py seed_sequence: at least the number of seeds
    "margin": hinted(_number(0), "the practical margin in nats of XSA - SA, fixed in the plan before the runs"),
    "null_arm": _bool,
    "tune_xsa": _bool,
    "stall": stall,
    "diverge_above": hinted(
        _number(0, low_open=True, nullable=True),
        "a final val loss above it counts as diverged; null: ln(vocabulary size), a uniform guess",
    ),
    "max_parallel": _int(1),
    "launch_prefix": command_prefix,
    "wandb_report": _bool,
    "eval_tasks": eval_tasks,
    "eval_limit": hinted(_number(0, low_open=True, nullable=True), "the first N examples per task; null: all"),
}

SCALE_RULES: dict[str, Rule] = {
    "axis": choice("size", "tokens"),
    "models": checked_elsewhere,  # scale/run.py check_models: presets that exist, two or more on the size axis
    "seeds": hinted(seed_list(nullable=True), "the compare seeds at every size; null: sweep.seeds"),
    "fit": checked_elsewhere,  # scale/run.py check_analysis: auto or a form of scale/fit.py
    "bootstrap_resamples": _int(100),
    "bootstrap_seed": _int(0, SEED_MAX),
    "wandb_report": _bool,
    "tokens_per_param": _number(0, low_open=True),
    "sa_budgets": positive_numbers("[0.5,1,2]"),
    "xsa_budgets": positive_numbers("[0.5,1]"),
    "lr_per_budget": _bool,
    "warmup_fraction": hinted(
        _number(0, 1, high_open=True, nullable=True),
        "the share of each run's steps spent warming up; null: the recipe's",
    ),
    "allow_repeated_data": _bool,
    "measure_throughput": _bool,
    "bench_rounds": _int(2),
    "bench": checked_elsewhere,  # scale/run.py load_bench: a results.json of `xsa-lm bench`, or null
}


def check_settings(node: DictConfig, rules: dict[str, Rule], group: str) -> None:
    """Every key of the group against its rule, in one line naming each bad value; a key without a rule is one the
    command does not have (`+sweep.lr=...`), a rule without a key a config that lost it."""
    bad = [
        f"{group}.{key}: not a setting of `xsa-lm {group}` (it has {', '.join(rules)})"
        for key in map(str, node)
        if key not in rules
    ]
    for key, rule in rules.items():
        if key not in node:
            bad.append(f"{group}.{key} is missing from the config: set it")
            continue
        problem = rule(node[key])
        if problem:
            bad.append(f"{group}.{key}={plain(node[key])} {problem}")
    if bad:
        raise UserError("; ".join(bad))
