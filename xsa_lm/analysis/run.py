"""`xsa-lm analyze ckpts=[A,B,...] hydra.run.dir=DIR`: the Figure 1 diagnostics and held-out loss of checkpoints on
the first `sequences` validation windows of each one's run: DIR/diagnostics.csv and .png (a line per checkpoint),
DIR/losses.csv and positions.png (loss per equal span of window positions), the tables printed with the differences."""

import os
import re
from pathlib import Path

import hydra
import pandas as pd  # type: ignore[import-untyped]  # no stubs installed
import torch
from hydra.core.hydra_config import HydraConfig
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from omegaconf import DictConfig
from pydantic import model_validator

from xsa_lm.analysis.diagnostics import METRICS, diagnose
from xsa_lm.analysis.losses import held_out_loss
from xsa_lm.checkpoints.load import Texts, checkpoint_list, load_model, run_config, run_data, run_dir_of, told_apart
from xsa_lm.config.spec import Count, Spec, parse
from xsa_lm.data.datamodule import PackedWindows
from xsa_lm.data.prepare import PreparedData
from xsa_lm.data.tokenizer import token_byte_lengths
from xsa_lm.errors import UserError, one_line_errors
from xsa_lm.files import atomic_file
from xsa_lm.reporting import saved_figure


class AnalyzeOptions(Spec):
    ckpts: Texts
    labels: Texts | None
    sequences: Count
    batch_size: Count
    chunk: Count
    position_buckets: Count

    @model_validator(mode="after")
    def _one_label_each(self) -> "AnalyzeOptions":  # equal labels would draw two checkpoints as one line
        labels = self.labels or []
        if self.labels is not None and len(labels) != len(self.ckpts):
            raise ValueError(f"labels: {len(labels)} labels for {len(self.ckpts)} checkpoints")
        if repeated := sorted({repr(label) for label in labels if labels.count(label) > 1}):
            raise ValueError(f"labels: {', '.join(repeated)} labels more than one checkpoint: give each its own")
        return self


# (metric, panel title, y label): the paper's Figure 1, then the two statistics of the XSA step itself.
PANELS = (
    ("cos_v_v", "value similarity", "mean cos(v_i, v_j), i < j"),
    ("a_ii", "attention on itself", "mean a_ii"),
    ("cos_y_v", "output vs own value", "mean cos(y_i, v_i)"),
    ("cos_z_v", "after the XSA step (XSA layers)", "mean cos(z_i, v_i)"),
    ("norm_removed", "norm removed by XSA (XSA layers)", "mean 1 - ||z_i|| / ||y_i||"),
)
# The narrowest y range of a panel, so that noise is no trend: XSA's cos(z, v) ~1e-7 reads as 0; else rounding.
MIN_SPAN = {"cos_z_v": 0.1}


def validation_set(path: Path, n: int) -> tuple[torch.Tensor, torch.Tensor, PreparedData]:
    """Inputs and targets (n, T) of the first n validation windows of the checkpoint's run, and its data."""
    block_size, data = run_config(path)["data"]["block_size"], run_data(path)
    windows = PackedWindows(data.shards("val"), block_size)
    if n > len(windows):
        print(f"sequences={n}, but {path}'s validation split holds {len(windows)} windows: measuring all of them")
    pairs = [windows[i] for i in range(min(n, len(windows)))]
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs]), data


def default_labels(paths: list[Path], attentions: list[str]) -> list[str]:
    """The run directory's name, with the attention where the name does not say it; told apart where two share it."""
    labels = []
    for path, attention in zip(paths, attentions, strict=True):
        run = run_dir_of(path).name
        labels.append(run if attention in re.split(r"[^a-z0-9]+", run.lower()) else f"{run} ({attention})")
    numbered = [f"{label} {path.stem} #{i}" for i, (label, path) in enumerate(zip(labels, paths, strict=True))]
    return told_apart(labels, paths, numbered)


def analyze(options: AnalyzeOptions) -> tuple[list[dict], list[dict]]:
    """One diagnostics row per checkpoint and layer, one loss row per checkpoint (with the tokens measured on)."""
    checkpoint_list(options.ckpts)  # each a checkpoint, before any slow work
    device = "cuda" if torch.cuda.is_available() else "cpu"
    paths = [Path(ckpt).expanduser() for ckpt in options.ckpts]
    buckets, batch_size = options.position_buckets, options.batch_size
    diagnostics, losses, attentions = [], [], []
    for path in paths:
        model = load_model(path).to(device)
        x, y, data = validation_set(path, options.sequences)
        if buckets > x.shape[1]:  # spans without a position would be reported empty
            raise UserError(f"position_buckets={buckets} is above the {x.shape[1]} positions of {path}'s windows")
        x, y = x.to(device), y.to(device)
        which = {"checkpoint": os.path.abspath(path)}  # readable from anywhere
        diagnostics += [which | row for row in diagnose(model, x.split(batch_size), options.chunk)]
        token_bytes = token_byte_lengths(data.tokenizer, model.config.vocab_size)
        loss = held_out_loss(model, x, y, token_bytes=token_bytes, buckets=buckets, batch_size=batch_size)
        spans = {f"span_{i}": value for i, value in enumerate(loss.by_position, start=1)}
        # The prepared data names its tokenizer; the window's length sets which tokens and positions are measured.
        measured_on = {"data": data.dir.name, "windows": loss.windows, "block_size": x.shape[1]}
        losses.append(which | measured_on | {"loss": loss.loss, "bpb": loss.bpb} | spans)
        attentions.append(model.config.attention)
    labels = options.labels or default_labels(paths, attentions)
    label = {os.path.abspath(path): name for path, name in zip(paths, labels, strict=True)}
    diagnostics, losses = ([{"label": label[str(r["checkpoint"])]} | r for r in rows] for rows in (diagnostics, losses))
    return diagnostics, losses


def figure(rows: list[dict], reference: list[dict] | None = None) -> Figure:
    """PANELS per layer, a line per checkpoint label; `reference` (the paper's values) against relative depth, so
    that models of other depths share the axis. A Figure, not pyplot's: it needs no display."""
    fig = Figure(figsize=(14, 7.5))
    *axes, legend_ax = fig.subplots(2, 3).flat
    table = pd.DataFrame(rows).astype({"layer": float})
    paper = pd.DataFrame(reference or [], columns=["layer", *METRICS[:3]]).astype(float)
    if reference:  # layer / last layer
        table["layer"] /= table.groupby("label")["layer"].transform("max").clip(lower=1)
        paper["layer"] /= max(len(paper) - 1, 1)
    last = 1 if reference else table["layer"].max()
    for ax, (metric, title, ylabel) in zip(axes, PANELS, strict=True):
        for i, (label, mine) in enumerate(table.groupby("label", sort=False)):  # SA has no z (None, or "" in a CSV)
            points = mine.assign(y=pd.to_numeric(mine.get(metric), errors="coerce")).dropna(subset="y")
            if len(points):
                ax.plot(points["layer"], points["y"], marker="o", markersize=3, color=f"C{i % 10}", label=label)
        if metric in paper and len(paper):
            ax.plot(paper["layer"], paper[metric], "k--", marker="s", markersize=3, label="paper Fig. 1 (24-layer SA)")
        ax.set(title=title, ylabel=ylabel, xlabel="relative depth (layer / last layer)" if reference else "layer")
        if not ax.lines:  # SA checkpoints only: no z to measure
            note = "no XSA layers among these checkpoints"
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="0.4")
            ax.set(xticks=[], yticks=[])
            continue
        low, high = ax.get_ylim()
        half = max(high - low, MIN_SPAN.get(metric, 1e-3)) / 2
        ax.set_ylim((low + high) / 2 - half, (low + high) / 2 + half)
        margin = 0.05 * last or 0.5
        ax.set_xlim(-margin, last + margin)  # every panel spans every layer: the XSA-only ones line up with the rest
        if not reference:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers: no 0.5 ticks
        ax.grid(alpha=0.3)
    handles = {line.get_label(): line for ax in axes for line in ax.lines}  # a line label once, across panels
    legend_ax.axis("off")
    legend_ax.legend(list(handles.values()), list(handles), loc="center", title="checkpoint")
    fig.tight_layout()
    return fig


def positions_figure(losses: list[dict], path: Path) -> None:
    """The loss per equal span of window positions, a line per checkpoint: how it falls with the context."""
    spans = span_columns(losses)
    curves = pd.DataFrame(losses, columns=["label", *spans]).set_index("label").T.astype(float)
    curves.index = range(1, len(spans) + 1)
    with saved_figure(path, figsize=(7, 4.5)) as ax:
        curves.plot(ax=ax, marker="o", markersize=3, title="validation loss per span of window positions")
        xlabel = f"span of positions (1 to {len(spans)}: equal spans of the window, earliest first)"
        ax.set(xlabel=xlabel, ylabel="mean loss (nats per token)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(title="checkpoint")


def span_columns(losses: list[dict]) -> list[str]:
    return [key for key in losses[0] if key.startswith("span_")] if losses else []


def markdown(rows: list[dict], columns: list[str]) -> str:
    table = pd.DataFrame(rows, columns=columns).astype(object)
    return table.where(table.notna(), None).to_markdown(index=False, floatfmt=".4f", missingval="-")


def render(diagnostics: list[dict], losses: list[dict]) -> str:
    """The two tables, then each checkpoint's difference from the first per span, where measured on the same tokens."""
    spans = span_columns(losses)
    lines = [markdown(diagnostics, ["label", "layer", "attention", *METRICS]), ""]
    lines.append(markdown(losses, ["label", "windows", "loss", "bpb", *spans]))
    tokens = [f"{r['windows']} windows of {r['block_size']} tokens of {r['data']}" for r in losses]
    for r, measured_on in zip(losses[1:], tokens[1:], strict=True):
        first, pair = losses[0], f"{r['label']} - {losses[0]['label']}"
        per_span = " ".join("-" if None in (r[s], first[s]) else f"{r[s] - first[s]:+.4f}" for s in spans)
        lines.append(
            f"{pair} per span: {per_span} (loss {r['loss'] - first['loss']:+.4f})"
            if measured_on == tokens[0]  # a difference of other tokens means nothing
            else f"{pair}: not compared (measured on {measured_on}, against {tokens[0]})"
        )
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="analyze")
@one_line_errors
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    diagnostics, losses = analyze(parse(AnalyzeOptions, cfg))
    out.mkdir(parents=True, exist_ok=True)
    figure(diagnostics).savefig(out / "diagnostics.png", dpi=120)
    positions_figure(losses, out / "positions.png")
    # diagnostics.csv last: it marks a finished analyze (a rerun refuses its folder), so one cut short can run again
    for rows, columns, name in (
        (losses, ["checkpoint", "label", "data", "windows", "loss", "bpb", *span_columns(losses)], "losses.csv"),
        (diagnostics, ["checkpoint", "label", "layer", "attention", *METRICS], "diagnostics.csv"),
    ):
        with atomic_file(out / name, "w", newline="") as f:
            pd.DataFrame(rows, columns=columns).to_csv(f, index=False)
    print(render(diagnostics, losses))
    written = [out / name for name in ("diagnostics.csv", "diagnostics.png", "losses.csv", "positions.png")]
    print(f"\nwrote {', '.join(map(str, written[:-1]))} and {written[-1]}")
