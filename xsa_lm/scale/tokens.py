"""`xsa-lm scale scale.axis=tokens`: XSA's multiplier along the token axis at each fixed model size.

At each size of scale.models, with B = scale.tokens_per_param x its non-embedding parameters:
1. search: SA at B for every LR of the size's grid x sweep.search_seeds; the LR with the lowest median loss
2. budgets: at that LR, SA at every budget of scale.sa_budgets (x B) and XSA at every one of scale.xsa_budgets,
   each for every compare seed (paired: a seed's runs share initialisation and data order)
3. bench (scale.measure_throughput): `xsa-lm bench` of SA vs XSA at this size: the wall-clock k with its interval
4. k per (size, XSA budget) from SA's tokens-to-loss curve (token_axis.py), pooled over cells; results.json,
   report.md, loss_vs_tokens.png, multiplier.png

Every run is an `xsa-lm train` process of the sweep's Launcher with its record under sizes/<model>/<phase>/, so
the same command resumes the study; the plan (budgets, seeds) is fixed at the first run.
"""

import json
import subprocess
import sys
import time
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import cast

from hydra import compose
from omegaconf import DictConfig

from xsa_lm.errors import UserError
from xsa_lm.records import JsonObject
from xsa_lm.scale.report import SizeBench, TokenPlan, TokenRun, TokenSize, TokenStudyResult, write_report
from xsa_lm.scale.study import Study, StudyIdentity, compare_seeds
from xsa_lm.scale.token_axis import (
    STALL_SAFE_SEEDS,
    PooledK,
    bootstrap_interval,
    cell_estimate,
    per_seed_k,
    pool,
    stalled,
)
from xsa_lm.stats.decision import margin_verdict
from xsa_lm.stats.paired import paired_stats
from xsa_lm.stats.positions import position_differences
from xsa_lm.sweep.protocol import NULL, Selection, Trial, lr_grid, search_trials
from xsa_lm.sweep.report import bpb_stats
from xsa_lm.sweep.run import keep_plan, selection_of, stop_on_signals, train_overrides
from xsa_lm.sweep.settings import ScaleSpec, SweepSpec, parse
from xsa_lm.sweep.trials import Launcher, TrialRecord, TrialStore, check_trials, gpu_slots, last_error_line

SET_BY_TOKEN_AXIS = {
    "scheduler.warmup_steps": "scale.warmup_fraction sets each run's warmup from its steps (null: the recipe's)",
    "trainer.max_steps": "scale.axis=tokens sets each run's steps from scale.tokens_per_param and the budgets",
    "val_every_steps": "scale.axis=tokens validates at half and at the end of each run",
}


def non_embedding_params(model: str, overrides: list[str]) -> int:
    """The non-embedding parameters of a size as its runs will build it: the study's overrides (an experiment, model.*
    keys) with model=<size>, composed by Hydra within the running app; the model on the meta device."""
    import torch

    from xsa_lm.config.builders import model_config
    from xsa_lm.model.gpt import GPT

    cfg = compose(config_name="train", overrides=[*overrides, f"model={model}"])
    with torch.device("meta"):
        return GPT(model_config(cfg, vocab_size=cfg.model.vocab_size or 64)).num_params(non_embedding=True)


class SizePlan:
    """The runs of one size: its LR grid, its budget B in tokens, the steps of each budget, and how each phase runs
    (a Launcher of its trials)."""

    def __init__(self, study_dir: Path, model: str, cfg: DictConfig, overrides: list[str]) -> None:
        grids = cfg.sweep.lr_grids or {}
        self.grid = lr_grid(cfg.sweep.lrs, cfg.sweep.lr_range, grids.get(model, grids.get("default")))
        self.model = model
        self.dir = study_dir / "sizes" / model
        self.params = non_embedding_params(model, overrides)
        self.batch_tokens = int(cfg.global_batch_tokens)
        self.tokens = cfg.scale.tokens_per_param * self.params  # B
        self.cfg = cfg
        self.overrides = overrides

    def steps(self, fraction: float) -> int:
        return max(1, round(fraction * self.tokens / self.batch_tokens))

    def train_overrides(self, fraction: float) -> list[str]:
        """What the runs of a budget train with: the study's training overrides, the size and the budget's steps."""
        steps = self.steps(fraction)
        settings = [f"model={self.model}", f"trainer.max_steps={steps}", f"val_every_steps={max(1, -(-steps // 2))}"]
        warmup = self.cfg.scale.get("warmup_fraction")
        if warmup is not None:  # a fixed warmup would be half of the shortest run and a sliver of the longest
            settings.append(f"scheduler.warmup_steps={max(1, round(warmup * steps))}")
        return [*self.overrides, *settings]

    def run(self, trials: list[Trial], phase: str, fraction: float, group: str | None, job_type: str) -> TrialStore:
        """The trials of one phase at one budget, each an `xsa-lm train` process; their records' store."""
        store = TrialStore(self.dir / phase)
        launcher = Launcher(
            store,
            self.train_overrides(fraction),
            max_parallel=self.cfg.sweep.max_parallel,
            launch_prefix=self.cfg.sweep.launch_prefix or [],
            wandb_group=group,
            diverge_above=self.cfg.sweep.diverge_above,
        )
        stop_on_signals(launcher.stop, "scale")
        launcher.run(trials, phase, job_type)
        return store


def search_at(plan: SizePlan, fraction: float, seeds: list[int], arm: str, group: str | None) -> Selection:
    """The LR search of one arm at one budget: every LR of the grid x the search seeds, the lowest median loss."""
    trials = search_trials(plan.grid, seeds, [arm])
    print(f"size {plan.model}: {arm.upper()} LR search at {fraction:g} B ({plan.steps(fraction)} steps)")
    phase = "search" if fraction == 1.0 else f"search_{fraction:g}"
    return selection_of(plan.run(trials, phase, fraction, group, "lr-search"), trials)


def check_repeats(size: SizePlan, top: float) -> None:
    """Refuse a size whose largest SA budget passes over the training split more than once, before any run: the
    runs' data, prepared (or found in the cache) as their `xsa-lm train` will prepare it, gives the split's tokens.
    Repeated tokens teach less than new ones, which flattens SA's curve at the top, where k is read."""
    from xsa_lm.config.spec import TrainSpec, parse
    from xsa_lm.data.run import prepare_data

    cfg = compose(config_name="train", overrides=size.train_overrides(top))
    train_tokens = int(prepare_data((spec := parse(TrainSpec, cfg)).data, spec.tokenizer).meta["train_tokens"])
    epochs = size.steps(top) * size.batch_tokens / train_tokens
    if epochs > 1:
        raise UserError(
            f"{size.model}: SA at {top:g} B would train {epochs:.2f} epochs of the {train_tokens:,} training tokens: "
            "lower scale.tokens_per_param or the largest of scale.sa_budgets, use a larger corpus, or allow it with "
            "scale.allow_repeated_data=true (the report then names the repetition)"
        )


def run_size(plan: SizePlan, study: TokenPlan, group: str | None) -> TokenSize:
    """The searches, the selected LRs and every budget's runs of one size; the per-seed losses for the estimator.
    With lr_per_budget, SA's LR is searched at every SA budget and each arm trains at SA's LR of its budget (the
    paper's protocol at each budget); else SA's LR at B serves every budget."""
    sa_budgets, xsa_budgets, seeds = study.sa_budgets, study.xsa_budgets, study.seeds
    print(
        f"size {plan.model}: {plan.params:,} non-embedding parameters, B = {plan.tokens:,.0f} tokens "
        f"({plan.steps(1.0)} steps)"
    )
    by_budget = sa_budgets if study.lr_per_budget else [1.0]
    searches: dict[str, dict[str, float | None]] = {}
    lrs: dict[str, float | None] = {}
    warnings: list[str] = []
    for fraction in sorted(by_budget, key=lambda f: f != 1.0):  # B first: the LR the earlier plan used everywhere
        selection = search_at(plan, fraction, study.search_seeds, "sa", group)
        searches[f"{fraction:g}"] = {f"{lr:g}": loss for lr, loss in selection.losses.items()}
        lrs[f"{fraction:g}"] = selection.lr
        warnings += [f"at {fraction:g} B: {w}" if len(by_budget) > 1 else w for w in selection.warnings]
    entry = TokenSize(
        model=plan.model,
        non_embedding_params=plan.params,
        tokens_B=plan.tokens,
        search=searches["1"],
        selected_lr=lrs["1"],
        searches=searches,
        selected_lrs=lrs,
        warnings=warnings,
        grid=plan.grid,
    )
    if study.tune_xsa:
        xsa = search_at(plan, 1.0, study.search_seeds, "xsa", group)
        xsa_search = {f"{lr:g}": loss for lr, loss in xsa.losses.items()}
        entry = replace(entry, xsa_search=xsa_search, xsa_selected_lr=xsa.lr)
    chosen = {f: lrs.get(f"{f:g}", lrs["1"]) for f in sorted(set(sa_budgets) | set(xsa_budgets))}
    if any(lr is None for lr in chosen.values()):
        return entry
    runs: dict[str, dict[str, list[TokenRun]]] = {"sa": {}, "xsa": {}}
    kept = [f.name for f in fields(TokenRun)]
    arms_by_budget = [("sa", sa_budgets), ("xsa", xsa_budgets)] + ([(NULL, xsa_budgets)] if study.null_arm else [])
    for fraction, lr in cast(dict[float, float], chosen).items():
        arms = [a for a, budgets in arms_by_budget if fraction in budgets]
        names = " and ".join(a.upper() for a in arms)
        print(f"size {plan.model}: {names} at {fraction:g} B ({plan.steps(fraction)} steps), LR {lr:g}, seeds {seeds}")
        trials = [Trial(arm, lr, seed) for seed in seeds for arm in arms]
        store = plan.run(trials, f"budget_{fraction:g}", fraction, group, "budget")
        for arm in arms:  # each run as its trial record has it (TokenRun's fields are some of the record's)
            records = [store.load(t) or TrialRecord.missing(t, "") for t in trials if t.attention == arm]
            runs.setdefault(arm, {})[f"{fraction:g}"] = [TokenRun(**{k: getattr(r, k) for k in kept}) for r in records]
    return replace(entry, runs=runs, seeds=seeds)


def bench_size(study_dir: Path, model: str, cfg: DictConfig, overrides: list[str]) -> SizeBench | None:
    """`xsa-lm bench` of SA vs XSA at this size (its own process; reused when its JSON exists): the step-time
    ratio with its interval, measured with both arms interleaved, not the trials' tokens/s."""
    out = study_dir / "bench" / f"{model}.json"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        model_keys = [o for o in overrides if o.split("=", 1)[0].startswith("model.")]
        micro = max(1, int(cfg.global_batch_tokens) // int(cfg.model.block_size))
        cmd = [
            sys.executable,
            "-m",
            "xsa_lm.cli",
            "bench",
            f"model={model}",
            *model_keys,
            f"micro_batch={micro}",
            "comparisons=[xsa_over_sa]",
            "backends=train",  # the kernel the study's runs trained with
            f"rounds={cfg.scale.bench_rounds}",
            f"out={out}",
        ]
        log = study_dir / "logs" / f"bench_{model}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            print(f"size {model}: xsa-lm bench failed: {last_error_line(log)} (no wall-clock multiplier)")
            return None
    ratio = json.loads(out.read_text())["ratios"]["xsa_over_sa_step_time"]
    return SizeBench(
        xsa_over_sa_step_time=ratio["median"],
        interval=ratio["interval"],
        rounds=len(ratio["rounds"]),
        file=str(out),
    )


def paired_losses(
    entry: TokenSize, sa_budgets: list[float], fraction: float, arm: str = "xsa"
) -> tuple[list[list[float]], list[float], list[int]]:
    """The seeds where every SA budget and `arm` (XSA, or the null arm) at `fraction` completed: SA's losses per
    budget, the arm's, the seeds."""
    runs = [*((entry.runs or {})["sa"][f"{f:g}"] for f in sa_budgets), (entry.runs or {})[arm][f"{fraction:g}"]]
    usable = [i for i in range(len(entry.seeds)) if all(r[i].status == "completed" for r in runs)]
    losses = [[cast(float, r[i].final_val_loss) for i in usable] for r in runs]
    return losses[:-1], losses[-1], [entry.seeds[i] for i in usable]


def same_budget(
    entry: TokenSize, fraction: float, arm: str, margin: float | None
) -> tuple[JsonObject | None, JsonObject | None]:
    """`arm` - SA at one budget both trained at, over the seeds where both completed: the paired tests of the loss
    (the record every study reports), and beside them the verdict against the plan's margin, bits per byte and the
    loss per span of window positions. (None, None) without such a pair."""
    runs = entry.runs or {}
    if f"{fraction:g}" not in runs.get("sa", {}) or f"{fraction:g}" not in runs.get(arm, {}):
        return None, None
    pairs = [
        (a, b)
        for a, b in zip(runs["sa"][f"{fraction:g}"], runs[arm][f"{fraction:g}"], strict=True)
        if a.status == b.status == "completed"
    ]
    if not pairs:
        return None, None
    sa, other = [cast(float, a.final_val_loss) for a, _ in pairs], [cast(float, b.final_val_loss) for _, b in pairs]
    diffs = [b - a for a, b in zip(sa, other, strict=True)]
    # beside the paired tests: the margin verdict, bits per byte (BpbStats), the loss per span (PositionDifferences)
    details: JsonObject = {"margin": margin_verdict(diffs, margin).to_json() if margin is not None else None}
    if all(a.final_val_bpb is not None and b.final_val_bpb is not None for a, b in pairs):
        sa_bpb = [cast(float, a.final_val_bpb) for a, _ in pairs]
        details["bpb"] = bpb_stats(sa_bpb, [cast(float, b.final_val_bpb) for _, b in pairs]).to_json()
    positions = position_differences(
        [a.final_val_loss_by_position or [] for a, _ in pairs], [b.final_val_loss_by_position or [] for _, b in pairs]
    )
    details["positions"] = positions.to_json() if positions else None
    return paired_stats(sa, other).to_json(), details


def null_cell(entry: TokenSize, sa_budgets: list[float], sa_tokens: list[float], fraction: float) -> JsonObject | None:
    """k of the null arm (SA from other initial weights, at XSA's budget) read off SA's curve as XSA's k is: under
    no effect k is 1, so its interval and per-seed spread are the yardstick's own noise."""
    if fraction not in [float(f) for f in (entry.runs or {}).get(NULL, {})]:
        return None
    sa, null, seeds = paired_losses(entry, sa_budgets, fraction, arm=NULL)
    if len(seeds) < 2:
        return None
    budget = tokens_of(entry, NULL, fraction)
    cell = cell_estimate(sa, sa_tokens, null, budget)
    per_seed = per_seed_k(sa, sa_tokens, null, budget)  # as the report prints each seed's k
    return {**cell.as_dict(), "paired_seeds": seeds, "per_seed_k": per_seed}


def repeated_data(entry: TokenSize) -> list[str]:
    """A warning per arm and budget whose runs passed over the training split more than once: repeated tokens
    teach less than new ones, which flattens the curve at its top budgets and with it k."""
    found = []
    for arm, budgets in (entry.runs or {}).items():
        for fraction, runs in budgets.items():
            epochs = max((r.data_epochs or 0.0 for r in runs), default=0.0)
            if epochs > 1:
                found.append(
                    f"{entry.model} {arm.upper()} at {fraction} B: {epochs:.2f} epochs of the training data (it "
                    "repeats, which flattens SA's curve where k is read: use a larger corpus or a smaller B)"
                )
    return found


def tokens_of(entry: TokenSize, arm: str, fraction: float) -> float:
    """The tokens the runs of one arm and budget trained on (the same for every seed)."""
    seen = [r.tokens_seen for r in (entry.runs or {})[arm][f"{fraction:g}"] if r.tokens_seen]
    return float(seen[0]) if seen else fraction * entry.tokens_B


@dataclass(frozen=True)
class TokenAnalysis:
    cells: list[JsonObject]  # one per size and XSA budget: the Cell, its tests, the null's, per-seed k, stalls
    pooled: PooledK | None
    warnings: list[str]


def analyse_tokens(
    sizes: list[TokenSize],
    sa_budgets: list[float],
    xsa_budgets: list[float],
    seed: int = 0,
    margin: float | None = None,
) -> TokenAnalysis:
    """k, Fieller interval and bootstrap check per (size, XSA budget), and XSA - SA at that budget when SA trained
    at it too (paired_stats); the pooled k with its heterogeneity; the sizes' warnings, then the analysis's."""
    cells, estimates = [], []
    warnings = [f"{s.model}: {w}" for s in sizes for w in s.warnings]
    for entry in sizes:
        if entry.runs is None:
            warnings.append(f"{entry.model}: no LR selected, so no budget runs")
            continue
        warnings += repeated_data(entry)
        sa_tokens = [tokens_of(entry, "sa", f) for f in sa_budgets]
        for fraction in xsa_budgets:
            sa, xsa, seeds = paired_losses(entry, sa_budgets, fraction)
            left_out = len(entry.seeds) - len(seeds)
            if left_out:
                warnings.append(
                    f"{entry.model} XSA at {fraction:g} B: {left_out} seed(s) left out (a run did not "
                    "complete: diverged, failed or missing; rerun the same command to retry failures)"
                )
            if len(seeds) < 2:
                warnings.append(f"{entry.model} XSA at {fraction:g} B: fewer than 2 complete seeds, no estimate")
                continue
            budget = tokens_of(entry, "xsa", fraction)
            cell = cell_estimate(sa, sa_tokens, xsa, budget)
            monotone = all(a > b for a, b in zip(cell.sa_means, cell.sa_means[1:], strict=False))
            if not monotone:
                warnings.append(
                    f"{entry.model}: SA's mean loss does not fall with every doubling of tokens "
                    f"({', '.join(f'{m:.4f}' for m in cell.sa_means)}): the curve is not a tokens-to-loss map"
                )
            row = {"model": entry.model, "fraction": fraction, **cell.as_dict(), "paired_seeds": seeds}
            row["same_budget"], row["same_budget_details"] = same_budget(entry, fraction, "xsa", margin)
            row["null"] = null_cell(entry, sa_budgets, sa_tokens, fraction)
            row["null_same_budget"], row["null_same_budget_details"] = same_budget(entry, fraction, NULL, margin)
            row["bootstrap_ci95"] = bootstrap_interval(sa, sa_tokens, xsa, budget, seed=seed)
            row["per_seed_k"] = per_seed_k(sa, sa_tokens, xsa, budget)
            row["sa_stalled"] = sa_stalled = [stalled(losses) for losses in sa]  # per SA budget
            row["xsa_stalled"] = xsa_stalled = stalled(xsa)
            if (any(sa_stalled) or xsa_stalled) and len(seeds) < STALL_SAFE_SEEDS:
                warnings.append(
                    f"{entry.model} XSA at {fraction:g} B: stalled seeds among {len(seeds)}, and k is read off the "
                    "mean curves: a stall shifts k, and simulated studies with 30% of SA seeds stalled gave the 95% "
                    f"interval 81% coverage at 5 seeds, 91-93% at 10-20 (tests/test_token_axis.py); read the per-seed "
                    f"k, or use {STALL_SAFE_SEEDS} seeds or more"
                )
            bench = entry.bench
            if bench and cell.k is not None and bench.interval:
                r, (r_lo, r_hi) = bench.xsa_over_sa_step_time, bench.interval
                lo, hi = cell.ci
                row["wallclock_k"] = cell.k / r
                row["wallclock_ci"] = [lo / r_hi if lo is not None else None, hi / r_lo if hi is not None else None]
            cells.append(row)
            estimates.append(cell)
    return TokenAnalysis(cells=cells, pooled=pool(estimates), warnings=warnings)


def reanalyse_tokens(saved: TokenStudyResult, when: str | None = None) -> TokenStudyResult:
    """A saved token study analysed again from its runs' final losses with the current analysis (no run is
    repeated); `reanalysed` says when."""
    plan = saved.plan
    analysis = analyse_tokens(saved.sizes, plan.sa_budgets, plan.xsa_budgets, margin=plan.margin)
    return replace(saved, **vars(analysis), reanalysed=when or time.strftime("%Y-%m-%d"))


def check_token_study(cfg: DictConfig, overrides: list[str]) -> TokenPlan:
    """Every setting of the token axis, before the study directory gets anything: the plan a rerun must keep. The
    runs themselves: check_token_axis."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in SET_BY_TOKEN_AXIS:
            raise UserError(f"{override}: {SET_BY_TOKEN_AXIS[key]}")
    sa_budgets = sorted(float(f) for f in cfg.scale.sa_budgets)  # their rules: ScaleSpec
    xsa_budgets = sorted(float(f) for f in cfg.scale.xsa_budgets)
    search_seeds, seeds = compare_seeds(parse(ScaleSpec, cfg.scale, "scale"), parse(SweepSpec, cfg.sweep, "sweep"))
    if len(seeds) < 2:
        raise UserError(f"scale.axis=tokens needs 2+ compare seeds for an interval (scale.seeds), got {seeds}")
    if cfg.scale.lr_per_budget and not set(xsa_budgets) <= set(sa_budgets):
        raise UserError(
            f"scale.lr_per_budget=true trains XSA at SA's LR of its budget, so every XSA budget {xsa_budgets} must be "
            f"one of scale.sa_budgets {sa_budgets}"
        )
    return TokenPlan(
        axis="tokens",
        tokens_per_param=cfg.scale.tokens_per_param,
        sa_budgets=sa_budgets,
        xsa_budgets=xsa_budgets,
        search_seeds=search_seeds,
        seeds=seeds,
        lr_per_budget=bool(cfg.scale.lr_per_budget),
        warmup_fraction=cfg.scale.warmup_fraction,
        tune_xsa=bool(cfg.sweep.tune_xsa),
        null_arm=bool(cfg.sweep.null_arm),
        allow_repeated_data=bool(cfg.scale.allow_repeated_data),
        margin=float(cfg.sweep.margin),
    )


def check_token_axis(cfg: DictConfig, study_dir: Path, overrides: list[str], models: list[str]) -> Study:
    """Every setting of the token axis (check_token_study) and each size's runs: its LR grid and its runs at B (an SA
    search run, an XSA run) composed and checked as their `xsa-lm train` will (check_trials), within the running
    Hydra app; its largest budget against the training data (check_repeats, unless scale.allow_repeated_data); and
    GPUs for the runs at once. Returns the study, ready to run."""
    plan = check_token_study(cfg, overrides)
    gpu_slots(cfg.sweep.max_parallel, cfg.sweep.launch_prefix or [])
    runs = train_overrides(overrides)  # sweep.* stays with the study
    sizes = [SizePlan(study_dir, model, cfg, runs) for model in models]
    for size in sizes:
        trials = [Trial("sa", size.grid[0], plan.search_seeds[0]), Trial("xsa", size.grid[0], plan.seeds[0])]
        check_trials(size.train_overrides(1.0), trials)
        if not plan.allow_repeated_data:
            check_repeats(size, max(plan.sa_budgets))
    return partial(run_token_study, cfg, plan=plan, sizes=sizes)


def run_token_study(
    cfg: DictConfig, identity: StudyIdentity, group: str | None, *, plan: TokenPlan, sizes: list[SizePlan]
) -> list[str]:
    """The token-axis study: the plan kept in scale.json, every size's runs, then the analysis and the report.
    Returns the runs that did not finish."""
    study_dir = Path(identity.study_dir)
    keep_plan(study_dir / "scale.json", plan.to_json(), grid=[])
    entries = []
    for size in sizes:
        entry = run_size(size, plan, group)
        bench = bench_size(study_dir, size.model, cfg, identity.overrides) if cfg.scale.measure_throughput else None
        entries.append(replace(entry, bench=bench))
    seed, margin = cfg.scale.bootstrap_seed, plan.margin
    analysis = analyse_tokens(entries, plan.sa_budgets, plan.xsa_budgets, seed=seed, margin=margin)
    results = TokenStudyResult(**vars(identity), plan=plan, sizes=entries, **vars(analysis))
    write_report(results, study_dir)
    return unfinished(results)


def unfinished(results: TokenStudyResult) -> list[str]:
    """Runs that did not end completed or diverged (a rerun retries them), each with its status, the first line of
    its error and its log, e.g. `m sa 2 B seed 2 (failed: killed by signal SIGKILL (out of memory?); log <path>)`."""
    missing = []
    for size in results.sizes:
        for arm, budgets in (size.runs or {}).items():
            for fraction, runs in budgets.items():
                for run in (r for r in runs if r.status not in ("completed", "diverged")):
                    error = (run.error or "").strip().splitlines()
                    why = f"{run.status}: {error[0][:200]}" if error else run.status
                    why += f"; log {run.log}" if run.log else ""
                    missing.append(f"{size.model} {arm} {fraction} B seed {run.seed} ({why})")
    return missing
