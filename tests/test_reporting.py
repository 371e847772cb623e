"""The report's figures: a plot of many runs summarises each arm (median and band), one of few names every run."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from xsa_lm.sweep import report
from xsa_lm.sweep.report import SweepResult, plot_curves

RESULTS = Path(__file__).parents[1] / "results"


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The axes of every figure the report saves, kept to be read after the file is written."""
    axes, save = [], report.saved_figure

    @contextmanager
    def keep(path: Path, **subplots: Any) -> Iterator[Any]:
        with save(path, **subplots) as ax:
            yield ax
        axes.append(ax)

    monkeypatch.setattr(report, "saved_figure", keep)
    return axes


def test_many_runs_are_drawn_as_each_arms_median_and_band(tmp_path: Path, drawn: list[Any]) -> None:
    results = SweepResult.read(RESULTS / "null_toy" / "results.json")  # 12 seeds x SA, XSA and the null arm
    plot_curves(results, tmp_path / "curves.png")
    (ax,) = drawn
    assert (tmp_path / "curves.png").stat().st_size > 0
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert legend == [f"{arm} median, 10-90% band (12 seeds)" for arm in ("SA", "XSA", "NULL")]
    runs = [line for line in ax.lines if line.get_label().startswith("_")]  # matplotlib's name for no label
    assert len(runs) == 36
    sa = [t for t in results.trials if t.attention == "sa" and t.phase == "compare"]
    expected = np.median([[h["val_loss"] for h in t.val_history] for t in sa], axis=0)
    median = next(line for line in ax.lines if line.get_label().startswith("SA median"))
    np.testing.assert_allclose(median.get_ydata(), expected)


def test_few_runs_are_each_named(tmp_path: Path, drawn: list[Any]) -> None:
    results = SweepResult.read(RESULTS / "demo_noise" / "results.json")
    compare = [t for t in results.trials if t.phase == "compare" and t.seed <= 4]  # 8 runs: seeds 1-4, SA and XSA
    plot_curves(replace(results, trials=compare), tmp_path / "curves.png")
    legend = [text.get_text() for text in drawn[0].get_legend().get_texts()]
    assert sorted(legend) == sorted(f"{t.attention.upper()} seed {t.seed}" for t in compare)
