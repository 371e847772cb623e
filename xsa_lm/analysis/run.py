"""`xsa-lm analyze ckpts=[A,B,...] hydra.run.dir=DIR`: the Figure 1 diagnostics of trained checkpoints.

Writes DIR/diagnostics.csv (one row per checkpoint and layer), DIR/diagnostics.png (three panels like the paper's
Figure 1, one line per checkpoint, so SA and XSA overlay) and prints the table. Each checkpoint is measured on the
first `sequences` validation windows of its own run's data (the same windows for runs on the same data).
"""

import csv
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from xsa_lm.analysis.diagnostics import METRICS, diagnose
from xsa_lm.checkpoints import checkpoint_list, load_model
from xsa_lm.data.datamodule import PackedWindows
from xsa_lm.data.run import prepare_data
from xsa_lm.errors import UserError, exit_on_user_error

PANELS = (("cos_v_v", "mean cos(v_i, v_j)"), ("a_ii", "mean a_ii"), ("cos_y_v", "mean cos(y_i, v_i)"))


def validation_windows(path: Path, n: int) -> torch.Tensor:
    """The first n validation windows of the data the checkpoint's run trained on (from its config.yaml)."""
    run_config = path.parent.parent / "config.yaml"
    if not run_config.exists():
        raise UserError(f"ckpts: {run_config} not found: analyze reads the run's data settings from it")
    cfg = OmegaConf.load(run_config)
    data = prepare_data(cfg.data, cfg.tokenizer)
    windows = PackedWindows(data.shards("val"), cfg.data.block_size)
    return torch.stack([windows[i][0] for i in range(min(n, len(windows)))])


def analyze(ckpts: list[str], labels: list[str] | None, sequences: int, chunk: int, batch: int) -> list[dict]:
    if labels is not None and len(labels) != len(ckpts):
        raise UserError(f"labels: {len(labels)} labels for {len(ckpts)} checkpoints")
    rows = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for i, ckpt in enumerate(ckpts):
        path = Path(ckpt).expanduser()
        model = load_model(path).to(device)
        windows = validation_windows(path, sequences).to(device)
        label = labels[i] if labels else f"{model.config.attention}:{path.parent.parent.name}"
        for row in diagnose(model, windows.split(batch), chunk):
            rows.append({"checkpoint": str(path), "label": label, **row})
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    columns = ["checkpoint", "label", "layer", "attention", *METRICS]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row[k] is None else row[k]) for k in columns})


def plot(rows: list[dict], path: Path, reference: list[dict] | None = None) -> None:
    """Three panels like the paper's Figure 1: per-layer curves, one line per checkpoint. `reference` rows
    (the paper's own values) are drawn against relative depth when the layer counts differ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    labels = list(dict.fromkeys(row["label"] for row in rows))
    relative = reference is not None
    for ax, (metric, title) in zip(axes, PANELS, strict=True):
        for label in labels:
            mine = [r for r in rows if r["label"] == label]
            depth = [r["layer"] / max(len(mine) - 1, 1) if relative else r["layer"] for r in mine]
            ax.plot(depth, [r[metric] for r in mine], marker="o", markersize=3, label=label)
        if reference:
            depth = [r["layer"] / max(len(reference) - 1, 1) for r in reference]
            paper = [r[metric] for r in reference]
            ax.plot(depth, paper, "k--", marker="s", markersize=3, label="paper Fig. 1 (24-layer SA)")
        ax.set_title(title)
        ax.set_xlabel("relative depth" if relative else "layer")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    lines = [f"{'label':<28}{'layer':>6}{'attn':>6}" + "".join(f"{m:>14}" for m in METRICS)]
    for r in rows:
        cells = "".join(f"{'-' if r[m] is None else format(r[m], '.4f'):>14}" for m in METRICS)
        lines.append(f"{r['label'][:27]:<28}{r['layer']:>6}{r['attention']:>6}{cells}")
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="analyze")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    with exit_on_user_error():
        rows = analyze(checkpoint_list(cfg.ckpts), list(cfg.labels) if cfg.labels else None, cfg.sequences, cfg.chunk,
                       cfg.batch_size)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "diagnostics.csv")
    plot(rows, out / "diagnostics.png")
    print(table(rows))
    print(f"\nwrote {out / 'diagnostics.csv'} and {out / 'diagnostics.png'}")
