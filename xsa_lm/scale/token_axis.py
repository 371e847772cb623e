"""XSA's multiplier along the token axis at a fixed model size, as pure functions. SA trains at budgets D_1 < D_2 < ...
and XSA at b, seeds paired: k = D_SA / b, D_SA where SA's mean loss, linear in ln D between the bracketing budgets,
reaches XSA's. Nothing is extrapolated: beyond SA's range k is a bound.
The 95% interval is Fieller's by test inversion: on [D_j, D_j+1] theta is kept when the per-seed SA_j,s + theta
(SA_j+1,s - SA_j,s) - XSA_s have a mean Student's t does not reject at 0 (a quadratic, solved exactly); the union over
segments is the interval. A seed bootstrap checks it; cells pool by inverse variance on ln k, with Cochran's Q."""

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import scipy.stats

from xsa_lm.records import Record

ALPHA = 0.05
STALL_MARGIN = 0.15  # nats above the median of a budget's seeds: the sweep's stall margin (sweep.stall.margin)
STALL_SAFE_SEEDS = 10  # with stalled SA seeds, the fewest seeds at which Fieller's interval covered >= 90% simulated


@dataclass
class Cell:
    """One size and one XSA budget: the estimate, its interval and how each end is bounded."""

    budget: float  # XSA's tokens
    sa_budgets: list[float]  # SA's tokens, ascending
    k: float | None  # None: outside SA's range (see bound)
    bound: str | None  # e.g. "k > 2" when XSA's mean loss lies beyond SA's range
    ci: tuple[float | None, float | None]  # None at an end: unbounded within SA's range (that end is a bound)
    ln_k_se: float | None  # delta-method standard error of ln k (for pooling); None with a bound
    sa_means: list[float]
    xsa_mean: float
    seeds: int

    def as_dict(self) -> dict[str, Any]:  # as results.json holds it: the interval under ci95
        return {k: v for k, v in asdict(self).items() if k != "ci"} | {"ci95": list(self.ci)}


def _segment_solutions(a: np.ndarray, d: np.ndarray, t: float) -> list[tuple[float, float]]:
    """The theta in [0, 1] where |mean(a - theta d)| <= t se(a - theta d) over seeds: a quadratic in theta."""
    n = len(a)
    ma, md = float(a.mean()), float(d.mean())
    cov = np.cov(np.vstack([a, d]), ddof=1) / n
    vaa, vad, vdd = float(cov[0, 0]), float(cov[0, 1]), float(cov[1, 1])
    t2 = t * t
    qa, qb, qc = md * md - t2 * vdd, -2 * (ma * md - t2 * vad), ma * ma - t2 * vaa

    def inside(theta: float) -> bool:
        return qa * theta * theta + qb * theta + qc <= 1e-15

    if abs(qa) < 1e-300:
        roots: list[float] = [] if abs(qb) < 1e-300 else [-qc / qb]
    else:
        disc = qb * qb - 4 * qa * qc
        roots = [] if disc < 0 else sorted([(-qb - math.sqrt(disc)) / (2 * qa), (-qb + math.sqrt(disc)) / (2 * qa)])
    points = sorted({0.0, 1.0, *[r for r in roots if 0.0 < r < 1.0]})
    pieces = [(lo, hi) for lo, hi in zip(points, points[1:], strict=False) if inside((lo + hi) / 2)]
    if not pieces and any(inside(p) for p in points):
        pieces = [(p, p) for p in points if inside(p)]
    return pieces


def cell_estimate(
    sa: Sequence[Sequence[float]], sa_budgets: Sequence[float], xsa: Sequence[float], budget: float
) -> Cell:
    """k at one size and XSA budget: `sa[j][s]` SA's final loss at sa_budgets[j] for seed s, `xsa[s]` XSA's."""
    order = np.argsort(sa_budgets)
    budgets = [float(sa_budgets[i]) for i in order]
    runs = np.asarray([sa[i] for i in order], dtype=float)  # (budgets, seeds)
    x = np.asarray(xsa, dtype=float)
    n = x.size
    if n < 2 or runs.shape[1] != n:
        raise ValueError("cell_estimate needs at least 2 seeds, the same in every arm and budget")
    means = runs.mean(axis=1)
    lnD = np.log(budgets)
    xm = float(x.mean())
    t = float(scipy.stats.t.ppf(1 - ALPHA / 2, n - 1))

    k, bound, se = None, None, None
    lo_ratio, hi_ratio = budgets[0] / budget, budgets[-1] / budget
    if xm < means.min() and xm < means[-1]:
        bound = f"k > {hi_ratio:.3g}"
    elif xm > means[0]:
        bound = f"k < {lo_ratio:.3g}"
    else:
        for j in range(len(budgets) - 1):
            m1, m2 = means[j], means[j + 1]
            if min(m1, m2) <= xm <= max(m1, m2) and m1 != m2:
                theta = (m1 - xm) / (m1 - m2)
                ln_d = lnD[j] + theta * (lnD[j + 1] - lnD[j])
                k = math.exp(ln_d) / budget
                a, dd = runs[j] - x, runs[j] - runs[j + 1]
                var_theta = float(np.var(a - theta * dd, ddof=1) / n) / (m1 - m2) ** 2
                se = (lnD[j + 1] - lnD[j]) * math.sqrt(var_theta)
                break
    accepted: list[float] = []  # ln D values of the accepted set, segment by segment
    for j in range(len(budgets) - 1):
        for lo, hi in _segment_solutions(runs[j] - x, runs[j] - runs[j + 1], t):
            accepted += [lnD[j] + lo * (lnD[j + 1] - lnD[j]), lnD[j] + hi * (lnD[j + 1] - lnD[j])]
    if accepted:
        low, high = min(accepted), max(accepted)
        ci = (
            None if low <= lnD[0] + 1e-12 else math.exp(low) / budget,
            None if high >= lnD[-1] - 1e-12 else math.exp(high) / budget,
        )
    else:  # no ln D in SA's range is compatible: the interval lies wholly beyond one end
        ci = (hi_ratio, None) if xm < means[-1] else (None, lo_ratio)
    return Cell(float(budget), budgets, k, bound, ci, se, sa_means=[float(m) for m in means], xsa_mean=xm, seeds=n)


def bootstrap_interval(
    sa: Sequence[Sequence[float]], sa_budgets: Sequence[float], xsa: Sequence[float], budget: float, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile 95% interval of k over 2000 resamples of the seeds (a bound counts at SA's range); None below 3."""
    runs = np.asarray(sa, dtype=float)
    x = np.asarray(xsa, dtype=float)
    n = x.size
    if n < 3:
        return None
    rng = np.random.default_rng(seed)
    picks = (rng.integers(0, n, n) for _ in range(2000))
    values = [ln_k_of_means(runs[:, p].mean(axis=1), sa_budgets, float(x[p].mean()), budget) for p in picks]
    low, high = np.percentile(values, [2.5, 97.5])
    return float(math.exp(low)), float(math.exp(high))


def ln_k_of_means(means: np.ndarray, budgets: Sequence[float], xm: float, budget: float) -> float:
    """ln k from mean losses (SA's curve at its budgets), clipped to SA's range."""
    order = np.argsort(budgets)
    ln_k = np.log(np.asarray(budgets, dtype=float)[order]) - math.log(budget)  # ln(D / b) at each budget
    m = means[order]
    if xm <= m.min() and xm <= m[-1]:
        return float(ln_k[-1])
    if xm >= m[0]:
        return float(ln_k[0])
    for j in range(len(m) - 1):
        if min(m[j], m[j + 1]) <= xm <= max(m[j], m[j + 1]) and m[j] != m[j + 1]:
            theta = (m[j] - xm) / (m[j] - m[j + 1])
            return float(ln_k[j] + theta * (ln_k[j + 1] - ln_k[j]))
    return float(ln_k[-1])


def per_seed_k(
    sa: Sequence[Sequence[float]], sa_budgets: Sequence[float], xsa: Sequence[float], budget: float
) -> list[str]:
    """k of each seed from its own SA curve as the report prints it ("1.31", ">= 2", "<= 0.5"): shows a bimodal mix."""
    runs = np.asarray(sa, dtype=float)
    lo, hi = min(sa_budgets) / budget, max(sa_budgets) / budget
    values = []
    for s, x in enumerate(xsa):
        k = math.exp(ln_k_of_means(runs[:, s], sa_budgets, float(x), budget))
        values.append(
            f">= {hi:.3g}" if k >= hi * (1 - 1e-9) else f"<= {lo:.3g}" if k <= lo * (1 + 1e-9) else f"{k:.2f}"
        )
    return values


def stalled(losses: Sequence[float]) -> int:
    """The runs whose final loss lies more than STALL_MARGIN nats above the median of their arm and budget."""
    if len(losses) < 2:
        return 0
    median = float(np.median(losses))
    return sum(loss > median + STALL_MARGIN for loss in losses)


@dataclass(frozen=True, kw_only=True)
class PooledK(Record):
    """ln k pooled over the cells with a point estimate, and its heterogeneity."""

    k: float
    ci95: list[float]
    cells: int
    left_out: int
    cochran_q: float
    q_dof: int
    q_p_value: float | None
    i2: float


def pool(cells: Sequence[Cell]) -> PooledK | None:
    """Inverse-variance pooling of ln k over 2+ cells with a point estimate (bounds left out), Cochran's Q and I^2;
    cells at one size share SA's runs, so the pooled interval is then too narrow (the report says so)."""
    usable = [c for c in cells if c.k is not None and c.ln_k_se and c.ln_k_se > 0]
    if len(usable) < 2:  # one cell: its own interval (Fieller's) stands; t on its delta-method se would differ
        return None
    y = np.array([math.log(c.k) for c in usable if c.k is not None])
    w = np.array([1 / c.ln_k_se**2 for c in usable if c.ln_k_se])
    mean = float((w * y).sum() / w.sum())
    se = math.sqrt(1 / w.sum())
    q = float((w * (y - mean) ** 2).sum())
    dof = len(usable) - 1
    # Each ln k's variance comes from few seeds: Student's t on the fewest seeds' dof, not the normal z (simulated, 5
    # seeds, 2 independent cells: coverage 0.81-0.85 with z, 0.91-0.94 with t).
    z = float(scipy.stats.t.ppf(1 - ALPHA / 2, min(c.seeds for c in usable) - 1))
    return PooledK(
        k=math.exp(mean),
        ci95=[math.exp(mean - z * se), math.exp(mean + z * se)],
        cells=len(usable),
        left_out=len(cells) - len(usable),
        cochran_q=q,
        q_dof=dof,
        q_p_value=float(scipy.stats.chi2.sf(q, dof)) if dof > 0 else None,
        i2=max(0.0, (q - dof) / q) if q > 0 and dof > 0 else 0.0,
    )
