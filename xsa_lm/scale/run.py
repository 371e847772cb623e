"""`xsa-lm scale`: the sweep's protocol at several model sizes, and XSA's effective-compute multiplier at each.

1. for every model preset of scale.models, an `xsa-lm sweep` in DIR/sizes/<model>/ (LR search on SA, then SA vs XSA
   at the selected LR over the compare seeds): resumable, its trials reused when the same command runs again
2. fit the SA losses against training compute (fit.py) and convert XSA's loss at each size into compute: the
   multiplier, its bootstrap CI over seeds, and the same in wall-clock time (times XSA's over SA's throughput)
3. results.json, report.md, loss_vs_compute.png, multiplier.png, and a report run in the study's W&B group
"""

import importlib.resources
import json
import math
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, cast

import hydra
from omegaconf import DictConfig, OmegaConf

from xsa_lm.errors import UserError
from xsa_lm.scale.fit import (
    FORMS,
    bootstrap_multipliers,
    fit_loss_vs_compute,
    multiplier,
    multiplier_interval,
    wallclock_multiplier,
)
from xsa_lm.scale.report import log_to_wandb, write_report
from xsa_lm.sweep.run import (
    open_state,
    passed_on,
    report_run_settings,
    run_exclusive,
    stop_on_signals,
    train_overrides,
    wandb_settings,
)
from xsa_lm.sweep.trials import die_with_parent, last_error_line

SET_BY_SCALE = {  # model.* keys apply to every size (e.g. model.block_size)
    "model": "set the sizes with scale.models=[...]",
    "hydra.run.dir": "each size's sweep goes to <study dir>/sizes/<model>",
}


def sweep_overrides(task_overrides: list[str]) -> list[str]:
    """The command line's overrides passed on to every size's sweep (scale.* stays with the study)."""
    kept = passed_on(task_overrides, "scale", SET_BY_SCALE, setter="xsa-lm scale for each size")
    train_overrides(kept)  # what every size's sweep would refuse (attention=, optim.lr=, seed=): refused here first
    return kept


def open_study(study_dir: Path, overrides: list[str], cfg: DictConfig) -> dict:
    """scale.json: the study's identity. A rerun must train what the first run trained (sizes and seeds may be
    added: their sweeps run, the finished ones are reused)."""
    return open_state(
        study_dir / "scale.json",
        overrides,
        cfg,
        id_key="study_id",
        overrides_key="overrides",
        holds="a scaling study with the overrides",
    )


def check_models(models: Any) -> list[str]:
    names = [str(m) for m in models or []] if OmegaConf.is_list(models) or isinstance(models, list) else []
    if len(names) < 2 or len(set(names)) != len(names):
        raise UserError(
            f"scale.models needs at least two distinct model presets, smallest first, got {models!r}; "
            "e.g. scale.models=[tiny_d32,tiny_d64,tiny_d96,tiny]"
        )
    presets = importlib.resources.files("xsa_lm.configs") / "model"
    available = {p.name.removesuffix(".yaml") for p in presets.iterdir() if p.name.endswith(".yaml")}
    unknown = [m for m in names if m not in available]
    if unknown:
        known = ", ".join(sorted(available))
        raise UserError(f"scale.models: no model preset {', '.join(unknown)}; available: {known}")
    return names


class SizeRunner:
    """One `xsa-lm sweep` process per size, its output in logs/<model>.log and its progress on the terminal."""

    def __init__(self, study_dir: Path, overrides: list[str], seeds: list[int] | None, group: str | None) -> None:
        self.study_dir = study_dir
        self.overrides = overrides
        self.seeds = seeds
        self.group = group
        self.proc: subprocess.Popen | None = None

    def sweep_dir(self, model: str) -> Path:
        return self.study_dir / "sizes" / model

    def command(self, model: str) -> list[str]:
        cmd = [sys.executable, "-m", "xsa_lm.cli", "sweep", *self.overrides, f"model={model}"]
        cmd.append(f"hydra.run.dir={self.sweep_dir(model)}")
        if self.seeds is not None:
            cmd.append(f"sweep.seeds=[{','.join(map(str, self.seeds))}]")
        if self.group is not None:
            cmd.append(f"logger.wandb.group={self.group}")
        return cmd

    def run(self, model: str) -> int:
        log = self.study_dir / "logs" / f"{model}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command(model)
        with open(log, "a") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(cmd)}\n")
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
            in_report = False  # the sweep prints its report at the end: it stays in the log, the study reports
            assert self.proc.stdout is not None  # stdout=PIPE
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                in_report = (in_report or line.startswith("# SA vs XSA")) and not line.startswith("report:")
                if not in_report and line.strip():
                    print(f"[{model}] {line.rstrip()}", flush=True)
            returncode = self.proc.wait()
        self.proc = None
        return returncode

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()  # the sweep stops its trials and marks them interrupted
            self.proc.wait()


def model_compute(summary: dict) -> float:
    """Training FLOPs of a run: the model's FLOPs per token (GPT.flops_per_token) times the tokens it trained on."""
    import torch

    from xsa_lm.model.config import GPTConfig
    from xsa_lm.model.gpt import GPT

    with torch.device("meta"):  # the formula needs the shapes only
        model = GPT(GPTConfig(**summary["model_config"]))
    return model.flops_per_token() * summary["tokens_seen"]


def size_result(model: str, sweep_dir: Path, returncode: int, log: Path) -> dict:
    """What the fit needs from one size's sweep: the paired final losses, compute, throughput."""
    entry = {"model": model, "sweep_dir": str(sweep_dir), "sweep_returncode": returncode, "usable": False}
    results_file = sweep_dir / "results.json"
    if not results_file.exists():
        entry["error"] = last_error_line(log) or f"the sweep exited with code {returncode} before its report"
        return entry
    sweep = json.loads(results_file.read_text())
    compare = sweep["comparison"]
    runs = [t for t in sweep["trials"] if t["phase"] == "compare" and t["seed"] in compare["seeds"]]
    entry.update(
        selected_lr=sweep["selected_lr"],
        seeds=compare["seeds"],
        sa_runs=compare["sa"],
        xsa_runs=compare["xsa"],
        sa_mean=compare["sa_mean"],
        xsa_mean=compare["xsa_mean"],
        diff_ci95=compare["diff_ci95"],
        sweep_warnings=sweep["warnings"],
    )
    if not runs:
        entry["error"] = "no seed has both an SA and an XSA result (see the size's report)"
        return entry
    summary = json.loads((Path(runs[0]["run_dir"]) / "summary.json").read_text())
    entry["non_embedding_params"] = summary["non_embedding_params"]
    entry["tokens"] = summary["tokens_seen"]
    entry["compute"] = model_compute(summary)
    for attention in ("sa", "xsa"):
        speeds = [t["tokens_per_s"] for t in runs if t["attention"] == attention and t.get("tokens_per_s")]
        entry[f"{attention}_tokens_per_s"] = sum(speeds) / len(speeds) if speeds else None
    entry["usable"] = True
    return entry


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def fit_problems(usable: list[dict], fit: dict) -> list[str]:
    """Reasons the SA fit cannot convert losses into compute on this ladder; the multipliers then mean nothing."""
    problems = []
    ladder = sorted(usable, key=lambda s: s["compute"])
    steps = zip(ladder, ladder[1:], strict=False)
    rises = [f"{a['model']} -> {b['model']}" for a, b in steps if b["sa_mean"] >= a["sa_mean"]]
    if rises:
        problems.append(f"SA's mean loss does not fall as compute grows ({', '.join(rises)})")
    errors = [statistics.stdev(s["sa_runs"]) / math.sqrt(len(s["sa_runs"])) for s in usable if len(s["sa_runs"]) > 1]
    if errors and fit["rms_residual"] > 2 * max(errors):
        problems.append(
            f"the fit misses the SA means by {fit['rms_residual']:.4f} RMS, more than twice their largest "
            f"standard error over seeds ({max(errors):.4f})"
        )
    if fit["form"] == "power_law_offset" and fit["E"] <= 1e-6:
        problems.append("the irreducible loss E sits at its bound 0: the offset term is not identified")
    return problems


def analyse(sizes: list[dict], fit_form: str, resamples: int, seed: int) -> tuple[dict | None, list[str]]:
    """Fit SA's loss vs compute over the usable sizes; each size gets its multiplier, CI and wall-clock multiplier."""
    warnings = [f"{s['model']}: left out of the fit: {s['error']}" for s in sizes if not s["usable"]]
    warnings += [f"{s['model']}: {w}" for s in sizes for w in s.get("sweep_warnings", [])]  # e.g. a grid edge
    usable = [s for s in sizes if s["usable"]]
    compute = [s["compute"] for s in usable]
    fit = fit_loss_vs_compute(compute, [s["sa_mean"] for s in usable], fit_form)
    sa_runs, xsa_runs = [s["sa_runs"] for s in usable], [s["xsa_runs"] for s in usable]
    intervals = bootstrap_multipliers(compute, sa_runs, xsa_runs, form=fit.form, n_resamples=resamples, seed=seed)
    for size, interval in zip(usable, intervals, strict=True):
        k = float(multiplier(fit, size["sa_mean"], size["xsa_mean"]))
        size["multiplier"] = finite_or_none(k)
        if size["diff_ci95"] is None:
            size["multiplier_ci"] = None
            warnings.append(f"{size['model']}: fewer than 2 paired seeds: no interval")
        else:
            lo, hi = multiplier_interval(fit, size["sa_mean"], size["diff_ci95"])
            size["multiplier_ci"] = [lo, finite_or_none(hi)]
        size["multiplier_ci_bootstrap"] = [interval[0], finite_or_none(interval[1])] if interval else None
        wall = wallclock_multiplier(k, size["sa_tokens_per_s"], size["xsa_tokens_per_s"])
        size["wallclock_multiplier"] = finite_or_none(wall)
        if not math.isfinite(k) or (size["multiplier_ci"] and size["multiplier_ci"][1] is None):
            warnings.append(
                f"{size['model']}: XSA's loss (or its interval's lower end) is at or below the fit's "
                f"floor E = {fit.E:.4f}: no finite multiplier there (reported as null)"
            )
    problems = fit_problems(usable, fit.as_dict())
    if problems:
        warnings.insert(
            0,
            "the SA fit is unreliable, so no multiplier here means anything: "
            + "; ".join(problems)
            + ". More seeds per size, longer runs or a wider ladder of sizes would help",
        )
    if fit.form == "power_law" and len(usable) < 4:
        warnings.append(
            f"{len(usable)} sizes: a pure power law (no irreducible-loss term); 4 or more sizes fit L = E + A C^-alpha"
        )
    for size in sizes:
        size.pop("usable")
    return {**fit.as_dict(), "problems": problems}, warnings


def check_analysis(scale: DictConfig) -> None:
    """The analysis settings, before hours of training rather than after."""
    if scale.fit not in ("auto", *FORMS):
        raise UserError(f"scale.fit={scale.fit!r}: choose auto, {' or '.join(FORMS)}")
    resamples = scale.bootstrap_resamples
    if not isinstance(resamples, int) or isinstance(resamples, bool) or resamples < 100:
        raise UserError(f"scale.bootstrap_resamples must be an integer of at least 100, got {resamples!r}")
    if scale.get("seeds") is not None and not OmegaConf.is_list(scale.seeds):
        raise UserError(f"scale.seeds must be a list of seeds, e.g. scale.seeds=[1,2,3], got {scale.seeds!r}")


def run_study(cfg: DictConfig, study_dir: Path, overrides: list[str]) -> dict:
    models = check_models(cfg.scale.models)
    check_analysis(cfg.scale)
    seeds = cast(list[int], OmegaConf.to_container(cfg.scale.seeds)) if cfg.scale.get("seeds") is not None else None
    state = open_study(study_dir, overrides, cfg)
    OmegaConf.save(cfg, study_dir / "config.yaml", resolve=True)
    wandb_cfg = wandb_settings(cfg)
    runner = SizeRunner(study_dir, overrides, seeds, group=state["study_id"] if wandb_cfg else None)
    stop_on_signals(runner.stop, "scale")
    print(f"xsa-lm scale | {study_dir} | W&B group {state['study_id']} | sizes {models}")
    sizes = []
    for model in models:
        print(f"size {model}: xsa-lm sweep into {runner.sweep_dir(model)}")
        returncode = runner.run(model)
        log = study_dir / "logs" / f"{model}.log"
        if returncode == 2 and not (runner.sweep_dir(model) / "sweep.json").exists():
            raise UserError(f"the sweep of {model} was refused: {last_error_line(log)}")  # same for every size
        sizes.append(size_result(model, runner.sweep_dir(model), returncode, log))
    fit, warnings = analyse(sizes, cfg.scale.fit, cfg.scale.bootstrap_resamples, cfg.scale.bootstrap_seed)
    results = {
        "study_dir": str(study_dir),
        "study_id": state["study_id"],
        "overrides": overrides,
        "models": models,
        "seeds": seeds,
        "fit": fit,
        "sizes": sizes,
        "warnings": warnings,
    }
    write_report(results, study_dir)
    if wandb_cfg and cfg.scale.wandb_report:
        log_to_wandb(results, study_dir, report_run_settings(wandb_cfg))
    return results


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="scale")
def main(cfg: DictConfig) -> None:
    study_dir, results = run_exclusive("scale", sweep_overrides, partial(run_study, cfg))
    print("\n" + (study_dir / "report.md").read_text())
    print(f"report: {study_dir / 'report.md'} | results: {study_dir / 'results.json'}")
    incomplete = [s["model"] for s in results["sizes"] if s["sweep_returncode"] != 0]
    if incomplete:
        print(
            f"xsa-lm scale: the sweeps of {', '.join(incomplete)} did not finish: run the same command again to "
            "retry them",
            file=sys.stderr,
        )
        sys.exit(1)
