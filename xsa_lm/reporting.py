"""What the sweep and scaling-study reports share: the Jinja2 templates (xsa_lm/templates), how a number reads there,
markdown tables (pandas' to_markdown), a paired comparison's row, a report's files and the W&B run that carries it."""

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import jinja2

from xsa_lm.files import write_json, write_text
from xsa_lm.records import Record
from xsa_lm.stats.paired import PairedStats


def num(value: float | None, spec: str = ".4f") -> str:
    """A number in `spec` (a format spec: ".4f", "+.4f", ".3g", ".1%"); "-" where there is none (None, NaN, inf)."""
    return format(value, spec) if value is not None and math.isfinite(value) else "-"


def interval(ci: Sequence[float | None] | None, spec: str = "+.4f", *, none: str = "-") -> str:
    """[low, high] in `spec`; an end without a value is unbounded, and `none` stands for no interval."""
    if not ci:
        return none
    return "[" + ", ".join("unbounded" if end is None else num(end, spec) for end in ci) + "]"


def table(text: str, align: str) -> str:
    """A template's `| cell | cell |` lines (header first) as pandas' to_markdown writes them; `align`: l or r each."""
    import pandas as pd  # type: ignore[import-untyped]  # no stubs in use

    lines = text.strip("\n").split("\n")
    header, *rows = ([cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines)
    frame = pd.DataFrame(rows, columns=header, dtype=object)
    colalign = ["right" if a == "r" else "left" for a in align]
    return frame.to_markdown(index=False, colalign=colalign, disable_numparse=True) + "\n"


@functools.cache
def templates() -> jinja2.Environment:
    """The report templates (xsa_lm/templates): they lay out the text; the numbers come formatted by num and f."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("xsa_lm", "templates"),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(num=num, interval=interval, table=table, f=format)
    env.globals.update(paired_cells=paired_cells, PAIRED_HEADER=PAIRED_HEADER, PAIRED_ALIGN=PAIRED_ALIGN)
    env.globals.update(fmean=fmean, zip=zip)
    return env


def render(template: str, **values: Any) -> str:
    """The text of xsa_lm/templates/`template` for `values`."""
    return str(templates().get_template(template).render(**values))


PAIRED_HEADER = ["pairs", "mean", "sd", "95% CI (t)", "t p", "Wilcoxon p", "sign p", "lower"]
PAIRED_ALIGN = "rrrlrrrr"


def paired_cells(stats: PairedStats | Mapping[str, Any]) -> list[str]:
    """The cells of a paired comparison (PAIRED_HEADER); `stats` may be its JSON (with more keys)."""
    if isinstance(stats, Mapping):
        stats = PairedStats.from_json(dict(stats))  # its other keys left out
    ps = [num(p, ".3g") for p in (stats.t_p, stats.wilcoxon_p, stats.sign_p)]
    mean, sd, ci = num(stats.mean_diff, "+.4f"), num(stats.sd_diff), interval(stats.t_ci95)
    return [str(stats.pairs), mean, sd, ci, *ps, f"{stats.xsa_lower}/{stats.pairs}"]


def write_report_files(folder: Path, record: Record, markdown: str, plots: Mapping[str, Callable[..., None]]) -> str:
    """results.json, the plots (file name -> what draws `record` there) and report.md in `folder`; returns the text."""
    write_json(folder / "results.json", record.to_json())
    for name, plot in plots.items():
        plot(record, folder / name)
    write_text(folder / "report.md", markdown)
    return markdown


@contextmanager
def saved_figure(path: Path, **subplots: Any) -> Iterator[Any]:
    """The axes of a new figure (plt.subplots' arguments; 6 x 4 inches unless told), saved to `path` at the end."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the figure only goes to a file
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**{"figsize": (6, 4)} | subplots)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


@dataclass(frozen=True, kw_only=True)
class ReportRunSettings:
    """The logger.wandb settings that a report run (log_report_run) takes; the defaults are wandb_init's."""

    project: str = "xsa-lm"
    entity: str | None = None
    mode: str = "auto"
    init_timeout_s: float = 30.0


def log_report_run(
    folder: Path,
    wandb_cfg: ReportRunSettings,
    *,
    name: str,
    group: str,
    job_type: str,
    artifact_type: str,
    config: dict,
    table: tuple[str, list[str], list[list]],
    plots: dict[str, str],
    summary: dict,
) -> None:
    """A run in the study's W&B group: `table` (key, columns, rows), `plots` (key -> a .png in `folder`), `summary`,
    and the report's files (results.json, report.md, the plots) as its artifact `name`."""
    import wandb

    from xsa_lm.tracking import log_files_artifact, wandb_init

    run = wandb_init(
        save_dir=str(folder), name=name, run_config=config, group=group, job_type=job_type, **asdict(wandb_cfg)
    )
    table_key, columns, rows = table
    images = {key: wandb.Image(str(folder / png)) for key, png in plots.items()}
    run.log({table_key: wandb.Table(columns=list[str | int](columns), data=rows), **images})  # the type wandb names
    run.summary.update(summary)
    files = [folder / "results.json", folder / "report.md", *(folder / png for png in plots.values())]
    log_files_artifact(run, name=name, artifact_type=artifact_type, files=files)
    run.finish()
