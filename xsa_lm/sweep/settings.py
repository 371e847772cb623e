"""The settings of `xsa-lm sweep` (configs/sweep/paper.yaml) and `xsa-lm scale` (configs/_scale.yaml) as specs: each
field owns its type and range, and `xsa_lm.config.spec.parse` refuses a bad value in one line."""

import math
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from xsa_lm.bench.stats import MIN_ROUNDS
from xsa_lm.config.spec import SEED_MAX, Spec, group_options, rule
from xsa_lm.errors import UserError


@dataclass(frozen=True)
class StallRule:
    at_fraction: float = 0.4
    margin: float = 0.15
    loss_threshold: float | None = None  # also: the tokens each run needs to reach this val loss

    def __post_init__(self) -> None:
        values = [self.at_fraction, self.margin, 0.0 if self.loss_threshold is None else self.loss_threshold]
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values)
        if not numbers or not 0 < self.at_fraction <= 1 or self.margin < 0:
            raise UserError(
                f"sweep.stall needs 0 < at_fraction <= 1, margin >= 0 and loss_threshold null or a finite number, got "
                f"at_fraction={self.at_fraction!r}, margin={self.margin!r}, loss_threshold={self.loss_threshold!r}"
            )


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def numbers_problem(value: Any, example: str, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, list) or any(not is_number(v) or v <= 0 for v in value):
        return f"must be a list of positive numbers, e.g. {example}" + (", or null" if nullable else "")
    twice = sorted(v for v, n in Counter(float(v) for v in value).items() if n > 1)
    return f"lists {', '.join(f'{v:g}' for v in twice)} twice: list each value once" if twice else None


def seed_list(nullable: bool = False, example: str = "") -> BeforeValidator:
    """Distinct seeds, each in the range `seed` takes; with an example, at least one."""

    def check(value: Any) -> str | None:
        ints = isinstance(value, list) and all(type(s) is int and 0 <= s <= SEED_MAX for s in value)
        if (value is None and nullable) or (ints and len(set(value)) == len(value) and (value or not example)):
            return None
        some = "a non-empty list" if example else "a list"
        tail = ", or null" if nullable else f"; {example}" if example else ""
        return f"must be {some} of distinct integers from 0 to {SEED_MAX}{tail}"

    return rule(check)


def lr_range(value: Any) -> str | None:
    good = value is None or (
        isinstance(value, dict)
        and set(value) == {"min", "max", "num"}
        and all(is_number(value[k]) for k in ("min", "max"))
        and 0 < value["min"] < value["max"]
        and type(value["num"]) is int
        and value["num"] >= 2
    )
    return None if good else "must be {min:..,max:..,num:..} with 0 < min < max and an integer num >= 2, or null"


def lr_grids(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return "must map model names to LR lists, e.g. {tiny:[3e-3,1e-2,3e-2],default:[1e-4,3e-4]}"
    for name, lrs in value.items():
        problem = numbers_problem(lrs, "[1e-4,3e-4]") or (None if lrs else "must not be empty")
        if problem:
            return f"has {name!s}: {lrs}, which {problem}"
    return None


def eval_tasks(value: Any) -> str | None:
    words = value if isinstance(value, list) else [value]
    if value is None or (words and all(isinstance(w, str) and w for w in words)):
        return None
    return "must be null, paper, or a list of lm-eval task names or task YAML files"


def presets(value: Any) -> str | None:
    known = group_options("model")
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value) or len(set(value)) != len(value):
        return "must be a list of distinct model presets, e.g. [tiny_d32,tiny_d64,tiny_d96,tiny]"
    unknown = [m for m in value if m not in known]
    return f"has no model preset {', '.join(unknown)}; available: {', '.join(known)}" if unknown else None


RESERVED_ARMS = ("null", "placebo")  # the null arms' trials are named so (protocol.NULL, protocol.PLACEBO)


def arm_name(value: Any) -> str | None:
    if not isinstance(value, str) or not value:
        return "must be the name of an attention option (configs/attention/<name>.yaml), e.g. sa"
    return f"must not be {value}: the null arms' trials are named so" if value in RESERVED_ARMS else None


NullArm = Literal["init", "placebo"]


def null_arms(value: Any) -> Any:
    """sweep.null_arm as the list of null arms: false none, true (as before there were two) the init null."""
    listed = {False: [], True: ["init"]}.get(value, value) if isinstance(value, bool) else value
    listed = [listed] if isinstance(listed, str) else listed
    if not isinstance(listed, list) or len(set(map(str, listed))) != len(listed):
        raise ValueError("must be false, init, placebo or [init,placebo]")
    return listed


def arm_names(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return "must list one or more attention options (configs/attention/<name>.yaml), e.g. [xsa]"
    problem = next((p for name in value if (p := arm_name(name))), None)
    twice = sorted({name for name in value if value.count(name) > 1})
    return problem or (f"lists {', '.join(twice)} twice: list each arm once" if twice else None)


class SweepSpec(Spec):
    """`xsa-lm sweep`'s settings (configs/sweep/paper.yaml says what each does)."""

    baseline: Annotated[str, rule(arm_name)]  # the attention option whose LR is searched
    candidates: Annotated[list[str], rule(arm_names)]  # the attention options compared with the baseline at its LR
    # null: lr_range, else lr_grids
    lrs: Annotated[list[float] | None, rule(partial(numbers_problem, example="[1e-3,3e-3]", nullable=True))]
    lr_range: Annotated[dict[str, float] | None, rule(lr_range)]  # {min, max, num}: log-spaced
    lr_grids: Annotated[dict[str, list[float]] | None, rule(lr_grids)]  # model name -> its grid
    search_seeds: Annotated[list[int], seed_list(example="e.g. [0], or [0,10,20] to select on the median of 3")]
    seeds: Annotated[list[int] | None, seed_list(nullable=True)] = Field(description="[]: a search-only sweep")
    reuse_search_run: bool  # true: a search seed among the compare seeds (biased against XSA)
    seeds_until_significant: int | None  # add seed pairs until significant, up to this many (protocol.seed_sequence)
    margin: float = Field(ge=0, description="the practical margin in nats of XSA - SA, fixed in the plan")
    null_arm: Annotated[list[NullArm], BeforeValidator(null_arms)]  # A/A nulls beside the comparison
    placebo_scale: float = Field(default=1e-6, gt=0, description="the placebo's init_perturbation")
    tune_xsa: bool  # also grid-search XSA
    stall: dict[Literal["at_fraction", "margin", "loss_threshold"], float | None] | None  # StallRule checks them
    allow_mixed_code: bool = False  # reuse runs trained by other code (not in the plan: a rerun may switch it)
    diverge_above: float | None = Field(
        gt=0, description="a final val loss above it counts as diverged; null: ln(vocab size)"
    )
    wandb_report: bool  # a report run in the sweep's W&B group
    eval_tasks: Annotated[str | list[str] | None, rule(eval_tasks)]  # xsa-lm eval on the compare runs; null: none
    eval_limit: float | None = Field(gt=0, description="the first N examples per task; null: all")
    expected_sd: float | None = Field(
        gt=0,
        description="the sd of XSA - SA over seed pairs a pilot measured, for the detectable effect; null: not yet",
    )
    dry_run: bool  # list the trials and what they cost and detect, then exit: nothing trained or written

    @model_validator(mode="after")
    def _stalls(self) -> "SweepSpec":
        self.stall_rule  # noqa: B018  # its values checked now, not at the report after every run
        return self

    @model_validator(mode="after")
    def _arms(self) -> "SweepSpec":
        listed = f"[{','.join(self.candidates)}]"  # as typed on a command line
        if self.baseline in self.candidates:
            raise UserError(
                f"sweep.candidates={listed} contains the baseline {self.baseline} (sweep.baseline): a "
                "candidate is compared with the baseline, so list other attention options"
            )
        # The sequential rule stops at the first significant look of one difference; several would share its level.
        if self.seeds_until_significant is not None and len(self.candidates) > 1:
            raise UserError(
                f"sweep.seeds_until_significant adds seeds until one comparison is significant, and "
                f"sweep.candidates={listed} makes {len(self.candidates)}: set "
                "sweep.seeds_until_significant=null and fix the compare seeds (sweep.seeds), or compare one candidate"
            )
        return self

    def idle_settings(self, seeds: list[int]) -> None:
        """Refuse a setting turned on where it cannot act: the compare phase's without compare seeds (`seeds`, which
        scale.seeds may give), the evaluation's limit without its tasks."""
        acts_only_with: dict[str, tuple[Any, str, bool]] = {  # key: (its idle value, what it needs, whether there)
            "null_arm": ([], "compare seeds (sweep.seeds)", bool(seeds)),
            "seeds_until_significant": (None, "compare seeds (sweep.seeds) to add to", bool(seeds)),
            "reuse_search_run": (False, "compare seeds (sweep.seeds)", bool(seeds)),
            "eval_tasks": (None, "compare runs to evaluate (sweep.seeds)", bool(seeds)),
            "eval_limit": (None, "tasks (sweep.eval_tasks)", self.eval_tasks is not None),
            "expected_sd": (None, "compare seeds (sweep.seeds) to detect with", bool(seeds)),
        }
        for key, (idle, needs, present) in acts_only_with.items():
            value = getattr(self, key)
            if value != idle and not present:
                shown = str(value).lower() if isinstance(value, bool) else f"{value:g}" if is_number(value) else value
                shown = f"[{','.join(value)}]" if isinstance(value, list) else shown
                raise UserError(
                    f"sweep.{key}={shown} would do nothing: it needs {needs}, and this sweep has none; give them, or "
                    f"leave sweep.{key} out"
                )

    @property
    def arms(self) -> list[str]:
        """The baseline, then the candidates: the order of every table and of each compare seed's trials."""
        return [self.baseline, *self.candidates]

    @property
    def stall_rule(self) -> StallRule | None:
        return StallRule(**self.stall) if self.stall else None  # type: ignore[arg-type]  # StallRule checks them


class LauncherSpec(Spec):
    """How trials run (configs/launcher/<kind>.yaml says what each does): submitit jobs on this machine or on SLURM."""

    kind: Literal["local", "slurm"]
    max_parallel: int | None = Field(default=1, ge=1, description="jobs at once; null: all (slurm queues them)")
    timeout_min: int = Field(default=10080, ge=1)  # a trial's wall-clock limit (SLURM's --time)
    max_requeues: int = Field(default=3, ge=0)  # times a preempted trial continues from its checkpoint
    max_retries: int = Field(default=1, ge=0)  # times a trial whose job ended without a result is submitted again
    signal_delay_s: int = Field(default=120, ge=0)  # SIGUSR2 this long before the time limit: a checkpoint, requeue
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=0, ge=0)
    tasks_per_node: int | None = Field(default=None, ge=1, description="null: slurm one per GPU, local one")
    cpus_per_task: int | None = Field(default=None, ge=1)
    mem_gb: float | None = Field(default=None, gt=0)
    additional_parameters: dict[str, Any] = Field(default_factory=dict)  # more sbatch flags: {constraint: a100}
    setup: list[str] = Field(default_factory=list)  # shell lines before the trial (module load, source a venv)

    @model_validator(mode="after")
    def _local_bound(self) -> "LauncherSpec":
        if self.kind == "local" and self.max_parallel is None:
            raise UserError("launcher.max_parallel=null: launcher=local needs a number of trials at once, e.g. 2")
        return self

    @property
    def tasks(self) -> int:
        """A trial's processes per node: one per GPU on SLURM; locally one (Lightning starts the ranks of trainer=ddp)
        unless tasks_per_node says."""
        return self.tasks_per_node or (max(self.gpus_per_node, 1) if self.kind == "slurm" else 1)


# The scale.* settings that one axis reads and the other ignores.
AXIS_ONLY = {
    **dict.fromkeys(("fit", "bootstrap_resamples", "bench", "wandb_report"), "size"),
    **dict.fromkeys(
        ("tokens_per_param", "sa_budgets", "xsa_budgets", "lr_per_budget", "warmup_fraction", "allow_repeated_data")
        + ("measure_throughput", "bench_rounds"),
        "tokens",
    ),
}


class ScaleSpec(Spec):
    """`xsa-lm scale`'s settings (configs/_scale.yaml says what each does)."""

    axis: Literal["size", "tokens"]  # the sizes at one token budget, or token budgets per size
    models: Annotated[list[str], rule(presets)]  # model presets, two or more on the size axis
    seeds: Annotated[list[int] | None, seed_list(nullable=True)] = Field(
        description="the compare seeds at every size; null: sweep.seeds"
    )
    fit: Literal["auto", "power_law_offset", "power_law"]  # scale/fit.py FORMS
    bootstrap_resamples: int = Field(ge=100)  # behind the bootstrap intervals
    bootstrap_seed: int = Field(ge=0, le=SEED_MAX)  # the same resamples on every rerun
    wandb_report: bool  # a scale-report run in the study's W&B group
    tokens_per_param: float = Field(gt=0)  # B = this x the non-embedding parameters
    sa_budgets: Annotated[list[float], rule(partial(numbers_problem, example="[0.5,1,2]"))]  # in units of B
    xsa_budgets: Annotated[list[float], rule(partial(numbers_problem, example="[0.5,1]"))]  # in units of B, within SA's
    lr_per_budget: bool  # SA's LR searched at every SA budget
    warmup_fraction: float | None = Field(ge=0, lt=1, description="the share of each run's steps warming up")
    allow_repeated_data: bool  # false: a budget past one epoch is refused
    measure_throughput: bool  # xsa-lm bench SA vs XSA at each size
    bench_rounds: int = Field(ge=MIN_ROUNDS)  # of the throughput bench: the fewest with a 95% interval
    bench: str | None  # a results.json of `xsa-lm bench` (scale/run.py load_bench)

    def refuse_other_axis(self, overrides: list[str]) -> None:
        """A setting of the other axis given on the command line would do nothing: refused, naming it."""
        for override in overrides:
            key = override.split("=", 1)[0].lstrip("+~").removeprefix("scale.")
            axis = AXIS_ONLY.get(key)
            if axis is not None and axis != self.axis:
                raise UserError(
                    f"{override}: scale.{key} acts on scale.axis={axis} only, and this study is scale.axis="
                    f"{self.axis}: leave it out, or set scale.axis={axis}"
                )

    @model_validator(mode="after")
    def _sizes_and_budgets(self) -> "ScaleSpec":
        """A fit across sizes needs two; on the token axis, SA's budgets include 1 and span XSA's (no extrapolation)."""
        sa, xsa = sorted(self.sa_budgets), sorted(self.xsa_budgets)
        if self.axis == "size":
            if len(self.models) < 2:
                raise UserError(f"scale.models needs at least two distinct model presets, got {self.models}")
            return self
        if not self.models:
            raise UserError("scale.models needs a model preset, e.g. scale.models=[tiny_l3_d48]")
        if len(sa) < 2 or 1.0 not in sa:
            raise UserError(f"scale.sa_budgets needs 2+ positive budgets including 1 (the LR is chosen at B), got {sa}")
        if not xsa or any(not sa[0] <= f <= sa[-1] for f in xsa):
            raise UserError(f"scale.xsa_budgets must lie within SA's budgets [{sa[0]:g}, {sa[-1]:g}], got {xsa}")
        if self.lr_per_budget and not set(xsa) <= set(sa):
            raise UserError(
                f"scale.lr_per_budget=true trains XSA at SA's LR of its budget, so every XSA budget {xsa} must be "
                f"one of scale.sa_budgets {sa}"
            )
        return self
