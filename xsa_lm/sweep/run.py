"""`xsa-lm sweep`: the paper's protocol in one command.

1. search:  one SA run per LR of the grid, seed sweep.search_seed (with sweep.tune_xsa, XSA too)
2. select:  the LR with the lowest final val loss among SA runs (diverged runs never win)
3. compare: SA and XSA at that LR for every seed of sweep.seeds, which excludes the search seed: a compare run is
            never the search's winner, chosen partly for its noise (unless sweep.reuse_search_run=true)
4. report:  results.json, report.md, lr_sweep.png, curves.png, and a W&B report run

Every trial is an `xsa-lm train` process with the sweep's training overrides; its record in the sweep directory
makes the same command resumable (see trials.py).
"""

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from xsa_lm.errors import UserError, exit_on_user_error
from xsa_lm.locking import exclusive
from xsa_lm.sweep.protocol import (
    Selection,
    SequentialRule,
    Trial,
    check_seeds,
    compare_trials,
    lr_grid,
    search_trials,
    seed_sequence,
    select_lr,
)
from xsa_lm.sweep.report import build_results, ci_text, comparison_of, log_to_wandb, write_report
from xsa_lm.sweep.trials import Launcher, TrialStore

relaunch_argv: list[str] | None = None  # set by the CLI; unused: trials are launched as their own processes
SET_BY_SWEEP = {  # training keys each trial gets from the sweep, and where the user sets them instead
    "attention": "the sweep trains both SA and XSA",
    "optim.lr": "set the grid with sweep.lrs=[...] or sweep.lr_range",
    "seed": "set the seeds with sweep.search_seed and sweep.seeds=[...]",
    "resume": "running the same sweep command again resumes it",
    "progress_bar": "trials write their output to the sweep's logs/ folder",
}


def passed_on(task_overrides: list[str], group: str, set_by: dict[str, str], setter: str) -> list[str]:
    """The command line's overrides for the child processes: `group`.* stays with this command, and a key of set_by
    (key -> where to set it instead) is refused."""
    kept = []
    for override in task_overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == group or key.startswith(f"{group}."):
            continue
        if key in set_by:
            raise UserError(f"{override}: {key} is set by {setter}; {set_by[key]}")
        kept.append(override)
    return kept


def train_overrides(task_overrides: list[str]) -> list[str]:
    """The command line's training overrides, passed on to every trial (sweep.* stays with the sweep)."""
    set_by = {**SET_BY_SWEEP, "attention.name": SET_BY_SWEEP["attention"]}
    return passed_on(task_overrides, "sweep", set_by, setter="the sweep for each trial")


def open_sweep(sweep_dir: Path, overrides: list[str], cfg: DictConfig) -> dict:
    """sweep.json: the sweep's identity. A rerun must train what the first run trained (the LR grid and the
    seeds may change: new trials are added, finished ones reused)."""
    state_file = sweep_dir / "sweep.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if sorted(state["train_overrides"]) != sorted(overrides):
            raise UserError(
                f"{sweep_dir} holds a sweep with the training overrides {state['train_overrides']}, not {overrides}: "
                "rerun it with the same overrides to resume it, or choose a new hydra.run.dir"
            )
        return state
    wandb_cfg = cfg.logger.get("wandb") if cfg.logger else None
    state = {"sweep_id": (wandb_cfg.group if wandb_cfg else None) or sweep_dir.name, "train_overrides": overrides,
             "created": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}  # fmt: skip
    state_file.write_text(json.dumps(state, indent=2))
    return state


def phase_records(store: TrialStore, trials: list[Trial], phase: str) -> list[dict]:
    records = []
    for trial in trials:
        record = store.load(trial) or {"id": trial.id, "attention": trial.attention, "lr": trial.lr,
                                       "seed": trial.seed, "status": "missing"}  # fmt: skip
        records.append({**record, "phase": phase, "reused": record.get("phase", phase) != phase})
    return records


def selection_of(store: TrialStore, trials: list[Trial]) -> Selection:
    results = {}
    for trial in trials:
        record = store.load(trial) or {}
        results[trial.lr] = (record.get("status"), record.get("final_val_loss"))
    # Statuses already hold the sweep's divergence bound (trials.outcome): no second bound here.
    return select_lr(results, math.inf)


def run_sequential(launcher: Launcher, store: TrialStore, lr: float, seeds: list[int], search_seed: int,
                   cap: int) -> tuple[list[Trial], dict]:  # fmt: skip
    """The compare phase of sweep.seeds_until_significant: sweep.seeds first, then one seed pair at a time, with a
    look at the corrected CI after each, until it excludes 0 or cap seeds ran. A rerun replays the same looks on the
    reused trials, so it stops where the first run stopped, or continues where that one was cut short."""
    rule, order = SequentialRule.plan(len(seeds), cap), seed_sequence(seeds, search_seed, cap)
    looks, n, trials = [], rule.first_look, []
    while True:
        added = compare_trials(lr, order[len(trials) // 2 : n])  # the earlier pairs are final (else it returned)
        trials += added
        launcher.run(added, "compare", "compare")
        if not all(store.is_final(t) for t in trials):  # a failed or interrupted run: the next look waits for it
            return trials, rule.summary(looks, "incomplete")
        looks.append(rule.look(n, comparison_of(phase_records(store, trials, "compare")).diffs))
        stopped = rule.stopped(looks[-1])
        print(f"  look {len(looks)} of at most {rule.looks}: {n} seeds, {1 - rule.alpha_per_look:.2%} CI "
              f"{ci_text(looks[-1]['ci'])}: " + (f"stop ({stopped})" if stopped else "one more seed"))  # fmt: skip
        if stopped:
            return trials, rule.summary(looks, stopped)
        n += 1


def evaluate_compare(store: TrialStore, trials: list[Trial], tasks, limit, sweep_dir: Path) -> tuple[dict | None, str]:
    """`xsa-lm eval` on the final checkpoints of the compare runs (its own process, like a trial); the result is
    reused when the same checkpoints were evaluated before."""
    ckpts = [str(store.run_dir(t) / "checkpoints" / "last.ckpt") for t in trials if store.is_final(t)
             and (store.load(t) or {}).get("status") == "completed"]  # fmt: skip
    out = sweep_dir / "eval"
    if (out / "eval.json").exists():
        previous = json.loads((out / "eval.json").read_text())
        if sorted(r["checkpoint"] for r in previous["rows"]) == sorted(ckpts):
            return previous, ""
    tasks = f"[{','.join(map(str, tasks))}]" if isinstance(tasks, list | tuple) else str(tasks)
    cmd = [sys.executable, "-m", "xsa_lm.cli", "eval", f"ckpts=[{','.join(ckpts)}]", f"tasks={tasks}",
           f"hydra.run.dir={out}"] + ([f"limit={limit}"] if limit else [])  # fmt: skip
    print(f"phase 4: downstream evaluation of {len(ckpts)} checkpoints ({tasks})")
    store.logs.mkdir(parents=True, exist_ok=True)
    with open(store.logs / "eval.log", "a") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        from xsa_lm.sweep.trials import last_error_line

        return None, f"downstream evaluation failed: {last_error_line(store.logs / 'eval.log')} (see logs/eval.log)"
    return json.loads((out / "eval.json").read_text()), ""


def run_sweep(cfg: DictConfig, sweep_dir: Path, overrides: list[str]) -> tuple[dict, str]:
    from xsa_lm.train.run import check_config  # validate once, not in every trial

    grids = cfg.sweep.get("lr_grids") or {}
    grid = lr_grid(cfg.sweep.lrs, cfg.sweep.lr_range, grids.get(cfg.model.name, grids.get("default")))
    search_seed = cfg.sweep.get("search_seed", 0)
    seeds = check_seeds(cfg.sweep.seeds, search_seed, bool(cfg.sweep.get("reuse_search_run", False)))
    cap = cfg.sweep.get("seeds_until_significant")
    if cap is not None:
        seed_sequence(seeds, search_seed, cap)  # a bad cap fails now, before anything is written
    if cfg.sweep.max_parallel < 1:
        raise UserError(f"sweep.max_parallel must be at least 1, got {cfg.sweep.max_parallel}")
    check_config(cfg)
    state = open_sweep(sweep_dir, overrides, cfg)
    config_name = "config.yaml" if not (sweep_dir / "config.yaml").exists() else f"config.rerun-{int(time.time())}.yaml"
    OmegaConf.save(cfg, sweep_dir / config_name, resolve=True)

    store = TrialStore(sweep_dir)
    wandb_cfg = cfg.logger.get("wandb") if cfg.logger else None
    launcher = Launcher(store, overrides, cfg.sweep.max_parallel, cfg.sweep.launch_prefix or [],
                        wandb_group=state["sweep_id"] if wandb_cfg else None,
                        diverge_above=cfg.sweep.diverge_above)  # fmt: skip

    def stop(signum, frame):
        launcher.stop()
        print(f"\nxsa-lm sweep: interrupted ({signal.Signals(signum).name}); run the same command to resume",
              file=sys.stderr)  # fmt: skip
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    n_search = len(grid) * (2 if cfg.sweep.tune_xsa else 1)
    planned = f"compare seeds {seeds}" + (f", then more up to {cap} until significant" if cap is not None else "")
    print(f"xsa-lm sweep | {sweep_dir} | W&B group {state['sweep_id']} | LR grid {[f'{lr:g}' for lr in grid]}, "
          f"search seed {search_seed}, {planned} | {n_search} search + up to {2 * (cap or len(seeds))} compare "
          "trials")  # fmt: skip
    sa_search = search_trials(grid, search_seed, ["sa"])
    xsa_search = search_trials(grid, search_seed, ["xsa"]) if cfg.sweep.tune_xsa else []
    print("phase 1: LR search")
    launcher.run(sa_search + xsa_search, "search", "lr-search")
    selection = selection_of(store, sa_search)
    compare, sequential = [], None
    if selection.lr is not None:
        print(f"phase 2: selected LR {selection.lr:g}\nphase 3: SA vs XSA at LR {selection.lr:g}")
        if cap is None:
            compare = compare_trials(selection.lr, seeds)
            launcher.run(compare, "compare", "compare")
        else:
            compare, sequential = run_sequential(launcher, store, selection.lr, seeds, search_seed, cap)
            seeds = list(dict.fromkeys(trial.seed for trial in compare))  # the seeds it ran, in order

    evaluation, eval_warning = None, ""
    if cfg.sweep.get("eval_tasks") and compare:
        tasks = (
            OmegaConf.to_container(cfg.sweep.eval_tasks)
            if OmegaConf.is_list(cfg.sweep.eval_tasks)
            else cfg.sweep.eval_tasks
        )
        evaluation, eval_warning = evaluate_compare(store, compare, tasks, cfg.sweep.get("eval_limit"), sweep_dir)
    trials = phase_records(store, sa_search + xsa_search, "search") + phase_records(store, compare, "compare")
    xsa_selection = selection_of(store, xsa_search) if xsa_search else None
    results = build_results(sweep_dir, state["sweep_id"], grid, seeds, overrides, trials, selection, xsa_selection,
                            search_seed=search_seed, sequential=sequential)  # fmt: skip
    results["eval"] = evaluation
    if eval_warning:
        results["warnings"].append(eval_warning)
    markdown = write_report(results, sweep_dir)
    if wandb_cfg and cfg.sweep.wandb_report:
        wandb_kwargs = {k: v for k, v in OmegaConf.to_container(wandb_cfg, resolve=True).items()
                        if k in ("project", "entity", "mode", "init_timeout_s")}  # fmt: skip
        log_to_wandb(results, sweep_dir, wandb_kwargs)
    return results, markdown


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="sweep")
def main(cfg: DictConfig) -> None:
    sweep_dir = Path(HydraConfig.get().runtime.output_dir)
    with exit_on_user_error():
        overrides = train_overrides(list(HydraConfig.get().overrides.task))
        with exclusive(sweep_dir, "sweep.lock", "xsa-lm sweep"):
            results, markdown = run_sweep(cfg, sweep_dir, overrides)
    print("\n" + markdown)
    print(f"\nreport: {sweep_dir / 'report.md'} | results: {sweep_dir / 'results.json'}")
    unfinished = [t["id"] for t in results["trials"] if t["status"] not in ("completed", "diverged")]
    if unfinished:
        print(f"xsa-lm sweep: {len(unfinished)} trial(s) did not finish ({', '.join(unfinished)}): "
              "run the same command again to retry them", file=sys.stderr)  # fmt: skip
        sys.exit(1)
    if results["selected_lr"] is None:
        print("xsa-lm sweep: no usable LR in the grid (see the report's warnings)", file=sys.stderr)
        sys.exit(1)
