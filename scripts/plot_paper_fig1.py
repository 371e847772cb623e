"""Overlay the paper's own Figure 1 values (a trained 24-layer SA model) on `xsa-lm analyze` results.

    python scripts/plot_paper_fig1.py DIR/diagnostics.csv --out fig1_vs_paper.png

Layers are drawn against relative depth (layer / (n_layers - 1)) so a 4-layer toy and the paper's 24 layers share
an axis. The paper's values were read off its figure (approximate): scripts/data/paper_fig1.csv.
"""

import argparse
import csv
from pathlib import Path

from xsa_lm.analysis.run import figure

PAPER = Path(__file__).resolve().parent / "data" / "paper_fig1.csv"


def paper_rows() -> list[dict]:
    with open(PAPER) as f:
        return [
            {
                "layer": int(r["layer"]),
                "cos_v_v": float(r["mean_cos_vi_vj"]),
                "a_ii": float(r["mean_a_ii"]),
                "cos_y_v": float(r["mean_cos_yi_vi"]),
            }
            for r in csv.DictReader(f)
        ]


COLUMNS = ("layer", "cos_v_v", "a_ii", "cos_y_v")


def our_rows(path: Path) -> list[dict]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    missing = [c for c in COLUMNS if rows and c not in rows[0]]
    if not rows or missing:
        raise ValueError(f"{path} is not a diagnostics.csv of xsa-lm analyze (no rows, or no column {missing})")
    for row in rows:
        row["layer"] = int(row["layer"])
        for metric in COLUMNS[1:]:
            row[metric] = float(row[metric])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("diagnostics", type=Path, help="diagnostics.csv written by xsa-lm analyze")
    parser.add_argument("--out", type=Path, default=Path("fig1_vs_paper.png"))
    args = parser.parse_args()
    if not args.diagnostics.is_file():
        parser.error(f"{args.diagnostics}: no such file (xsa-lm analyze writes DIR/diagnostics.csv)")
    if args.out.exists():
        parser.error(f"--out {args.out} exists: choose another file (nothing is overwritten)")
    if not args.out.parent.is_dir():
        parser.error(f"--out {args.out}: the folder {args.out.parent} does not exist")
    try:
        rows = our_rows(args.diagnostics)
    except ValueError as e:
        parser.error(str(e))
    figure(rows, reference=paper_rows()).savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
