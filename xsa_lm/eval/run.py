"""`xsa-lm eval ckpts=[A,B,...] tasks=paper hydra.run.dir=DIR`: zero-shot tasks through lm-evaluation-harness; writes
DIR/eval.json and DIR/eval.md (the paper's Table 2: a row per checkpoint, the average, XSA - SA), logs to W&B."""

import hashlib
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Annotated
from unittest import mock

import hydra
import scipy.stats
import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer

from xsa_lm import reporting
from xsa_lm.checkpoints.load import Texts, checkpoint_list, load_model, load_tokenizer, run_dir_of, told_apart
from xsa_lm.config.spec import Count, Spec, parse, rule
from xsa_lm.data.tokenizer import eot_id, hub_unreachable
from xsa_lm.errors import UserError, one_line_errors, yaml_problem
from xsa_lm.export.run import hf_model, hf_tokenizer, require
from xsa_lm.files import write_json, write_text
from xsa_lm.model import GPT
from xsa_lm.records import Record
from xsa_lm.stats.paired import paired_t

if TYPE_CHECKING:  # lm-eval is an extra: imported only when evaluating
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

# The paper's Table 2: accuracy for BoolQ, LAMBADA, SocialIQA, WinoGrande; length-normalised accuracy for the rest.
PAPER_TASKS = dict.fromkeys(("arc_easy", "hellaswag", "openbookqa", "piqa"), "acc_norm")
PAPER_TASKS |= dict.fromkeys(("boolq", "lambada_openai", "social_iqa", "winogrande"), "acc")
HARNESS_REQUIREMENT = "lm-eval>=0.4.9,<0.5"  # the extra `eval` of pyproject.toml (test_packaging compares)


def _limit(value: object) -> str | None:
    # The harness reads a limit below 1 as a fraction of each task and cuts 2.5 down to 2; 0 would mean "every example"
    fine = value is None or (type(value) is int and value >= 1) or (type(value) is float and 0 < value < 1)
    return None if fine else "must be an integer >= 1 (the first N), a fraction in (0, 1) of each task, or null (all)"


class EvalOptions(Spec):
    ckpts: Texts
    baseline: str = "sa"  # the attention option every other arm is compared with
    tasks: str | list[str] | None
    limit: Annotated[int | float | None, rule(_limit)]
    batch_size: Count
    wandb: bool
    wandb_mode: str


@dataclass(frozen=True, kw_only=True)
class Score(Record):
    metric: str  # the task's headline metric (acc or acc_norm)
    value: float
    n: int  # the items scored
    stderr: float | None  # of the value over the items: their sample standard deviation / sqrt(n); None: one item


@dataclass(frozen=True, kw_only=True)
class Row(Record):  # one checkpoint's scores
    checkpoint: str
    attention: str
    run: str
    scores: dict[str, Score]
    average: float


@dataclass(frozen=True, kw_only=True)
class Difference(Record):
    """A candidate arm's mean scores minus the baseline's, per task and on average, and its intervals paired over
    the items both arms scored; counts: the candidate's and the baseline's checkpoints."""

    candidate: str
    mean: dict[str, float]
    ci95: dict[str, list[float] | None] | None = None
    counts: tuple[int, int] = (1, 1)


@dataclass(frozen=True, kw_only=True)
class EvalResult(Record):  # eval.json: each checkpoint's scores, and each other arm's minus the baseline's
    tasks: list[str]
    limit: int | float | None
    rows: list[Row]
    task_files: dict[str, str] = field(default_factory=dict)  # task_file_digests: the local task files' contents
    baseline: str = "sa"  # the arm the others are compared with (eval.json written before arms had names: SA, XSA)
    candidate: str = "xsa"  # the first other arm, whose difference the next two keys hold
    xsa_minus_sa: dict[str, float] | None = None
    xsa_minus_sa_ci95: dict[str, list[float] | None] | None = None  # paired over the items both arms scored
    more_differences: list[Difference] = field(default_factory=list)  # the arms after the first
    schema: int = 1

    @property
    def by_candidate(self) -> list[Difference]:
        if self.xsa_minus_sa is None:
            return []
        indices = arms(self.rows, self.baseline, self.candidate)
        counts = (len(indices[0]), len(indices[1]))
        first = Difference(candidate=self.candidate, mean=self.xsa_minus_sa, ci95=self.xsa_minus_sa_ci95, counts=counts)
        return [first, *self.more_differences]


def require_harness(needed_by: str = "xsa-lm eval") -> None:
    require("lm_eval", "lm-evaluation-harness", HARNESS_REQUIREMENT, needed_by)


def resolve_tasks(tasks: str | list[str] | None) -> tuple[list[str], list[str]]:
    """Task names and the folders of local task YAML files: `paper`, harness task names, or paths to YAML files."""
    entries = task_entries(tasks)
    if not entries:  # tasks=[], tasks=, tasks=null
        raise UserError("tasks: give at least one task, e.g. tasks=paper")
    names: dict[str, str] = {}  # name -> the entry that gave it
    for entry, path in entries:
        if path is not None and not path.is_file():
            raise UserError(f"tasks: task file not found: {path}")
        try:  # BaseLoader: plain values only, lm-eval's own tags (`!function utils.process_docs`) too
            config = {"task": entry} if path is None else yaml.load(path.read_text(), Loader=yaml.BaseLoader)
        except yaml.YAMLError as e:
            raise UserError(f"tasks: {path} is not valid YAML{yaml_problem(e)}") from None
        if not isinstance(config, dict) or "task" not in config:
            raise UserError(f"tasks: {path} is not a task file (a YAML mapping with a `task:` name)")
        name = str(config["task"])
        if name in names:  # one score per name: the second would replace the first, or count twice in the average
            raise UserError(f"tasks: {entry} is the task {name!r}, as {names[name]} is: give each task once")
        names[name] = entry
    return list(names), sorted({str(path.resolve().parent) for _, path in entries if path is not None})


def task_entries(tasks: str | list[str] | None) -> list[tuple[str, Path | None]]:
    """Each task given (`paper`: the paper's), with its path where it names a task YAML file."""
    given = list(PAPER_TASKS) if tasks == "paper" else [tasks] if isinstance(tasks, str) else list(tasks or [])
    paths = [(str(entry), Path(str(entry)).expanduser()) for entry in given if entry not in (None, "")]
    return [(entry, path if path.suffix in (".yaml", ".yml") else None) for entry, path in paths]


def task_file_digests(tasks: str | list[str] | None) -> dict[str, str]:
    """The sha256 of each local task file by its path: an edited file evaluates something else under one name."""
    files = [path for _, path in task_entries(tasks) if path is not None]
    return {str(file.resolve()): hashlib.sha256(file.read_bytes()).hexdigest() for file in files}


def task_manager(names: list[str], folders: list[str]) -> "TaskManager":
    """The harness's task index (about 10 s to build), refusing names it does not hold."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=folders or None)
    if unknown := [name for name in names if name not in manager.all_tasks]:
        raise UserError(f"tasks: unknown task(s) {unknown}: use lm-eval task names, `paper`, or task YAML files")
    return manager


def load_tasks(names: list[str], folders: list[str]) -> "TaskManager":
    """The harness's tasks with their data, one by one, so that a missing dataset names its task."""
    from lm_eval.tasks import get_task_dict

    manager = task_manager(names, folders)
    for name in names:
        try:
            get_task_dict([name], manager)
        except StopIteration:  # datasets' json builder on a file with no rows
            raise UserError(f"tasks: {name}: its data holds no items (an empty file?)") from None
        except (ConnectionError, OSError, ValueError) as e:  # datasets' offline / not-found errors
            raise UserError(
                f"tasks: {name}: its dataset is not available ({type(e).__name__}: {str(e).splitlines()[0][:150]}); "
                "offline, give its data as local files in a task YAML (dataset_path: json, data_files)"
            ) from None
    return manager


def headline(task: str, metrics: dict) -> tuple[str, float]:
    """The metric the paper reports for a task (acc or acc_norm); for other tasks acc_norm, acc, or the first."""
    for name in [PAPER_TASKS.get(task, "acc_norm"), "acc_norm", "acc"]:
        if f"{name},none" in metrics:
            return name, metrics[f"{name},none"]
    name, value = next((k, v) for k, v in metrics.items() if isinstance(v, int | float) and "stderr" not in k)
    return name.split(",")[0], value


def evaluate(
    ckpts: list[str], tasks: str | list[str] | None, limit: int | float | None, batch_size: int, baseline: str
) -> EvalResult:
    names, folders = resolve_tasks(tasks)  # the cheap checks first: no network probe or harness import for a typo
    # Offline before datasets and huggingface_hub read these (once): else the hub client retries for minutes
    if hub_unreachable() is not None:
        os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    import lm_eval
    import lm_eval.evaluator

    manager = load_tasks(names, folders)
    rows: list[Row] = []
    items: list[dict[str, dict[int, float]]] = []  # each row's value of each item, by task and doc_id
    for ckpt in ckpts:
        path = Path(ckpt).expanduser()
        model = load_model(path)
        lm = harness_lm(model, load_tokenizer(path), batch_size)
        # The harness runs git for the cwd's commit ("fatal: not a git repository" outside one); run_info.json has it
        with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None):
            out = lm_eval.simple_evaluate(
                model=lm, tasks=names, task_manager=manager, limit=limit, bootstrap_iters=0, log_samples=True
            )
        scores, values = {}, {}
        for task in names:
            metric, value = headline(task, out["results"][task])
            values[task] = {int(sample["doc_id"]): float(sample[metric]) for sample in out["samples"][task]}
            stderr = float(scipy.stats.sem(list(values[task].values()))) if len(values[task]) > 1 else None
            scores[task] = Score(metric=metric, value=value, n=len(values[task]), stderr=stderr)
        items.append(values)
        run, average = run_dir_of(path).name, fmean(s.value for s in scores.values())
        attention = arm_of(path, model)
        rows.append(Row(checkpoint=str(path), attention=attention, run=run, scores=scores, average=average))
    result = EvalResult(tasks=names, limit=limit, rows=rows, task_files=task_file_digests(tasks), baseline=baseline)
    return compared(result, items)


def check_baseline(ckpts: list[str], baseline: str) -> None:
    """The baseline compares where the checkpoints hold it and another arm: one set where it cannot (or absent among
    several arms) is refused before any scoring. Judged by each run's config.yaml; without one, not judged."""
    saved = [run_dir_of(Path(ckpt).expanduser()) / "config.yaml" for ckpt in ckpts]
    names = [OmegaConf.select(OmegaConf.load(f), "attention.name") if f.is_file() else None for f in saved]
    arms = sorted({str(name) for name in names if name is not None})
    if None in names or (baseline in arms and len(arms) > 1):
        return
    if len(arms) > 1 or baseline != EvalOptions.model_fields["baseline"].default:
        raise UserError(
            f"baseline={baseline} would compare nothing: the checkpoints are of {', '.join(arms)}, and a comparison "
            f"needs the baseline's and another arm's; set baseline to one of them, or add checkpoints of {baseline}"
        )


def arm_of(checkpoint: Path, model: GPT) -> str:
    """The attention option the checkpoint's run trained (its config.yaml), else the model's attention."""
    saved = run_dir_of(checkpoint) / "config.yaml"
    name = OmegaConf.select(OmegaConf.load(saved), "attention.name") if saved.exists() else None
    return str(name or model.config.attention)


def compared(result: EvalResult, items: list[dict[str, dict[int, float]]]) -> EvalResult:
    """The result with each other arm's difference from the baseline, in the order of the checkpoints (items: each
    row's value of each item, by task and doc_id)."""
    rows, tasks, baseline = result.rows, result.tasks, result.baseline
    differences = []
    for arm in dict.fromkeys(row.attention for row in rows):
        if (mean := minus_baseline(rows, tasks, baseline, arm)) is not None:
            ci, (own, base) = paired_intervals(rows, items, tasks, baseline, arm), arms(rows, baseline, arm)
            differences.append(Difference(candidate=arm, mean=mean, ci95=ci, counts=(len(own), len(base))))
    if not differences:
        return result
    first, *more = differences
    return replace(
        result, candidate=first.candidate, xsa_minus_sa=first.mean, xsa_minus_sa_ci95=first.ci95, more_differences=more
    )


def harness_lm(model: GPT, tokenizer: Tokenizer, batch_size: int) -> "HFLM":
    """The model `xsa-lm export` writes, with its tokenizer, in lm-eval's `hf` backend (on the GPU if there is one)."""
    import torch
    from lm_eval.models.huggingface import HFLM

    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # where its weights are made
        hf = hf_model(model, eot_id(tokenizer), tokenizer.get_vocab_size())
    hf_tok = hf_tokenizer(tokenizer, model.config.block_size)
    return HFLM(pretrained=hf, tokenizer=hf_tok, backend="causal", batch_size=batch_size)


def arms(rows: list[Row], baseline: str, candidate: str) -> list[list[int]]:
    """The indices of the candidate's rows, then of the baseline's."""
    return [[i for i, r in enumerate(rows) if r.attention == arm] for arm in (candidate, baseline)]


def paired_intervals(
    rows: list[Row], items: list[dict[str, dict[int, float]]], tasks: list[str], baseline: str, candidate: str
) -> dict[str, list[float] | None]:
    """95% interval of candidate - baseline per task, paired over the items both arms scored, and of the average (the
    tasks' half-widths added in quadrature, over T: their items are independent). The items' noise only, not the
    seeds'."""
    xsa, sa = arms(rows, baseline, candidate)
    intervals: dict[str, list[float] | None] = {}
    for task in tasks:
        shared = sorted(set.intersection(*(set(items[i][task]) for i in xsa + sa)))
        diffs = [fmean(items[i][task][d] for i in xsa) - fmean(items[i][task][d] for i in sa) for d in shared]
        intervals[task] = None if (ci := paired_t(diffs).ci) is None else list(ci)
    intervals["average"] = None
    known = [interval for task in tasks if (interval := intervals[task]) is not None]
    if len(known) == len(tasks):  # a t interval's centre is its mean difference
        mean, half = fmean((hi + lo) / 2 for lo, hi in known), math.hypot(*((hi - lo) / 2 for lo, hi in known))
        intervals["average"] = [mean - half / len(tasks), mean + half / len(tasks)]
    return intervals


def minus_baseline(rows: list[Row], tasks: list[str], baseline: str, candidate: str) -> dict[str, float] | None:
    """The candidate's mean score minus the baseline's per task and on average over each arm's checkpoints; None
    without both arms (or when the candidate is the baseline)."""
    xsa, sa = ([rows[i] for i in arm] for arm in arms(rows, baseline, candidate))
    if not xsa or not sa or candidate == baseline:
        return None
    diff = {task: fmean(r.scores[task].value for r in xsa) - fmean(r.scores[task].value for r in sa) for task in tasks}
    return diff | {"average": fmean(r.average for r in xsa) - fmean(r.average for r in sa)}


def render(result: EvalResult) -> str:
    """eval.md (xsa_lm/templates/eval.md.j2)."""
    rows, arm = result.rows, [row.attention.upper() for row in result.rows]
    paths, by_path = [Path(r.checkpoint) for r in rows], [f"{a} {r.checkpoint}" for a, r in zip(arm, rows, strict=True)]
    labels = told_apart([f"{a} {r.run}" for a, r in zip(arm, rows, strict=True)], paths, by_path)
    by_run: dict[tuple[str, Path], list[str]] = {}  # several checkpoints of one run in a mean are not seeds
    for row, label in zip(rows, labels, strict=True):
        by_run.setdefault((row.attention, run_dir_of(Path(row.checkpoint)).resolve()), []).append(label)
    note = "{}'s mean counts {} checkpoints of one run, {} ({}): they are not independent runs"
    notes = [note.format(a.upper(), len(n), run, ", ".join(n)) for (a, run), n in by_run.items() if len(n) > 1]
    return reporting.render("eval.md.j2", r=result, labels=labels, notes=notes).removesuffix("\n")


def log_to_wandb(result: EvalResult, mode: str) -> None:
    """Each checkpoint's scores into its own W&B run (wandb_run_id.txt), or a new `eval` run: the final model
    (last.ckpt) on whole tasks under eval/, another checkpoint or a limit under its own prefix."""
    from xsa_lm.tracking import wandb_init

    for row in result.rows:
        run_dir = run_dir_of(Path(row.checkpoint))
        id_file, saved = run_dir / "wandb_run_id.txt", run_dir / "config.yaml"  # written by xsa-lm train
        wandb_cfg = OmegaConf.select(OmegaConf.load(saved), "logger.wandb") if saved.exists() else None
        project, group = (wandb_cfg.project, wandb_cfg.group) if wandb_cfg else ("xsa-lm", None)
        run_id = id_file.read_text().strip() if id_file.exists() else None
        name, config = f"eval-{row.run}", {"eval_tasks": result.tasks}
        run = wandb_init(str(run_dir), name, config, project, group=group, job_type="eval", mode=mode, run_id=run_id)
        stem, limit = Path(row.checkpoint).stem, "" if result.limit is None else f"-limit{result.limit:g}"
        prefix = ("eval" if stem == "last" else f"eval-{stem}") + limit
        scores = {t: s.value for t, s in row.scores.items()} | {"average": row.average}
        run.summary.update({f"{prefix}/{t}": value for t, value in scores.items()})
        run.finish()


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="eval")
@one_line_errors
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    options = parse(EvalOptions, cfg)  # wandb too: before any scoring
    require_harness()  # first: a missing extra is the first thing to fix
    ckpts = checkpoint_list(options.ckpts)
    check_baseline(ckpts, options.baseline)
    result = evaluate(ckpts, options.tasks, options.limit, options.batch_size, options.baseline)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "eval.md", render(result) + "\n")
    write_json(out / "eval.json", result.to_json())  # last: it marks a finished eval's folder, which a rerun refuses
    if options.wandb:
        log_to_wandb(result, options.wandb_mode)
    print(f"{render(result)}\n\nwrote {out / 'eval.json'} and {out / 'eval.md'}")
