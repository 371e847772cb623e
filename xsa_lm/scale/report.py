"""The scaling study's outputs: results.json, report.md, loss_vs_compute.png, multiplier.png and a W&B report run."""

import json
import math
from pathlib import Path

from xsa_lm.scale.fit import Fit


def _num(value: float | None, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if value is not None and math.isfinite(value) else "-"


def _ci(interval: list | None) -> str:
    if not interval:
        return "-"
    return f"[{_num(interval[0], 3)}, {_num(interval[1], 3) if interval[1] is not None else 'unbounded'}]"


def fit_of(results: dict) -> Fit:
    fit = results["fit"]
    return Fit(form=fit["form"], E=fit["E"], A=fit["A"], alpha=fit["alpha"], c_ref=1.0, residuals=fit["residuals"])


def reading(size: dict, fit_ok: bool = True) -> str:
    """What the multiplier's interval says, in words."""
    if not fit_ok:
        return "unreliable fit (see the warnings)"
    ci = size.get("multiplier_ci")
    if not ci:
        return "no interval"
    lo, hi = ci
    if lo > 1:
        return "XSA better (CI above 1)"
    if hi is not None and hi < 1:
        return "XSA worse (CI below 1)"
    return "not resolved (CI contains 1)"


def fit_lines(results: dict) -> list[str]:
    """The SA fit of loss vs compute, and each size against it."""
    fit = results["fit"]
    lines = [
        "",
        "## SA loss vs training compute",
        "",
        f"Fit over the SA mean final losses ({fit['points']} sizes, {fit['parameters']} parameters, least "
        f"squares): **{fit['formula']}** (C in FLOPs = FLOPs per token x tokens trained). RMS residual "
        f"{fit['rms_residual']:.4f}.",
        "",
        "| model | non-embedding params | selected LR | compute (FLOPs) | SA mean | fit | residual |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    model = fit_of(results)
    residuals = iter(fit["residuals"])
    for size in results["sizes"]:
        if "compute" not in size:
            lines.append(f"| {size['model']} | - | - | - | - | - | left out |")
            continue
        lines.append(
            f"| {size['model']} | {size['non_embedding_params']:,} | {size['selected_lr']:g} | "
            f"{size['compute']:.3g} | {_num(size['sa_mean'])} | {_num(model.loss(size['compute']))} | "
            f"{next(residuals):+.4f} |"
        )
    return lines


def multiplier_lines(results: dict) -> list[str]:
    """XSA's effective-compute multiplier at each size, its intervals and what they say."""
    lines = [
        "",
        "## XSA's effective-compute multiplier",
        "",
        "k = C_fit(L_XSA) / C_fit(L_SA) at each size: the compute the SA fit needs to reach XSA's loss over "
        "the compute it needs to reach SA's (k > 1: XSA is worth k x the compute). 95% CI: the paired t "
        "interval of XSA - SA at that size, each end converted to compute through the fit (calibrated for "
        "seed noise; the fit's exchange rate held fixed). Bootstrap CI: seed pairs resampled within each size "
        "and the fit redone, so it carries the fit's uncertainty too, but it is too narrow with few seeds "
        "(measured on synthetic data: 76% coverage at 4 seeds). Wall-clock k: k x XSA's tokens/s over SA's in "
        "these runs.",
        "",
        "| model | seeds | SA mean | XSA mean | XSA - SA | k | 95% CI | bootstrap CI | wall-clock k | reading |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    fit_ok = not results["fit"].get("problems")
    for size in results["sizes"]:
        if "compute" not in size:
            continue
        diff = size["xsa_mean"] - size["sa_mean"]
        lines.append(
            f"| {size['model']} | {len(size['seeds'])} | {_num(size['sa_mean'])} | {_num(size['xsa_mean'])} "
            f"| {diff:+.4f} | {_num(size.get('multiplier'), 3)} | {_ci(size.get('multiplier_ci'))} | "
            f"{_ci(size.get('multiplier_ci_bootstrap'))} | "
            f"{_num(size.get('wallclock_multiplier'), 3)} | {reading(size, fit_ok)} |"
        )
    return lines


def render_markdown(results: dict) -> str:
    lines = [
        "# SA vs XSA across model sizes: effective-compute multiplier",
        "",
        f"- study directory: `{results['study_dir']}` (W&B group `{results['study_id']}`)",
        f"- overrides: `{' '.join(results['overrides']) or '(defaults)'}`",
        f"- sizes: {', '.join(results['models'])}; each size: LR search on SA, then SA vs XSA at its selected LR "
        "(its own `xsa-lm sweep` under `sizes/`)",
    ]
    if results["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- **{w}**" for w in results["warnings"]]
    lines += fit_lines(results) + multiplier_lines(results)
    lines += [
        "",
        "The fit runs along this ladder of sizes at a fixed token budget, not along a compute-optimal "
        "frontier: the multiplier is the compute SA would need on this ladder. Seed noise enters through the "
        "interval; the LR selected on SA at each size is reused for XSA (the paper's protocol).",
    ]
    return "\n".join(lines) + "\n"


def plot_loss_vs_compute(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import NullFormatter

    sizes = [s for s in results["sizes"] if "compute" in s]
    fig, ax = plt.subplots(figsize=(6, 4))
    for attention, color in (("sa", "tab:blue"), ("xsa", "tab:orange")):
        compute = [s["compute"] for s in sizes]
        runs = [s[f"{attention}_runs"] for s in sizes]
        means = [float(np.mean(r)) for r in runs]
        spread = [float(np.std(r, ddof=1)) if len(r) > 1 else 0.0 for r in runs]
        label = f"{attention.upper()} (mean ± sd over seeds)"
        ax.errorbar(compute, means, yerr=spread, fmt="o", color=color, capsize=3, label=label)
    model = fit_of(results)
    grid = np.geomspace(min(s["compute"] for s in sizes) / 1.5, max(s["compute"] for s in sizes) * 1.5, 100)
    ax.plot(grid, [model.loss(c) for c in grid], "-", color="tab:blue", alpha=0.6, label=f"SA fit: {model.describe()}")
    for s in sizes:
        ax.annotate(s["model"], (s["compute"], s["sa_mean"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # the minor labels of a short log axis overlap
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel("final validation loss")
    ax.set_title("Loss vs compute")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_multiplier(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    sizes = [s for s in results["sizes"] if s.get("multiplier") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(1.0, color="gray", linestyle="--", label="no difference")
    for s in sizes:
        x, k, ci = s["non_embedding_params"], s["multiplier"], s.get("multiplier_ci")
        if ci:
            hi = ci[1] if ci[1] is not None else k * 10
            ax.errorbar([x], [k], yerr=[[k - ci[0]], [hi - k]], fmt="o", color="tab:orange", capsize=4)
        else:
            ax.plot([x], [k], "o", color="tab:orange")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("non-embedding parameters")
    ax.set_ylabel("effective-compute multiplier k (95% CI)")
    unreliable = " (unreliable SA fit: see the report)" if results["fit"].get("problems") else ""
    ax.set_title("XSA vs SA: compute multiplier by size" + unreliable, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: dict, study_dir: Path) -> str:
    (study_dir / "results.json").write_text(json.dumps(results, indent=2))
    plot_loss_vs_compute(results, study_dir / "loss_vs_compute.png")
    plot_multiplier(results, study_dir / "multiplier.png")
    markdown = render_markdown(results)
    (study_dir / "report.md").write_text(markdown)
    return markdown


def log_to_wandb(results: dict, study_dir: Path, wandb_cfg: dict) -> None:
    """A `scale-report` run in the study's W&B group: the sizes table, both plots, and the report's files
    (results.json, report.md, the plots) as its artifact <study_id>-scale-report."""
    import wandb

    from xsa_lm.tracking import log_files_artifact, wandb_init

    config = {"models": results["models"], "seeds": results["seeds"], "overrides": results["overrides"]}
    name = f"{results['study_id']}-scale-report"
    run = wandb_init(
        save_dir=str(study_dir),
        name=name,
        run_config=config,
        group=results["study_id"],
        job_type="scale-report",
        **wandb_cfg,
    )
    columns = "model non_embedding_params selected_lr compute sa_mean xsa_mean multiplier wallclock_multiplier".split()
    rows = [[s.get(c) for c in columns] for s in results["sizes"] if "compute" in s]
    plots = {f"scale/{p}": wandb.Image(str(study_dir / f"{p}.png")) for p in ("loss_vs_compute", "multiplier")}
    table = wandb.Table(columns=list[str | int](columns), data=rows)  # the list type wandb's annotation names
    run.log({"scale/sizes": table, **plots})
    run.summary.update({"fit": results["fit"]["formula"], "fit_rms_residual": results["fit"]["rms_residual"]})
    files = [study_dir / f for f in ("results.json", "report.md", "loss_vs_compute.png", "multiplier.png")]
    log_files_artifact(run, name=name, artifact_type="scale-report", files=files)
    run.finish()
