"""Loss vs training compute, and XSA's effective-compute multiplier, as pure functions (no processes or files).

The SA baseline's final losses at several model sizes are fitted with
    L(C) = E + A * C^-alpha          (E: the irreducible loss; with fewer points, E = 0: a pure power law)
and, at each size, XSA's multiplier is the compute the SA fit needs to reach XSA's loss over the compute it needs
to reach SA's loss at that size: k = C_fit(L_XSA) / C_fit(L_SA). The fit only converts the loss gap at each size
into compute, so XSA = SA gives exactly k = 1 whatever the fit's residual at that point; with a residual of 0 it is
the usual C_fit(L_XSA) / C ("XSA reaches the loss SA reaches with k x the compute").
"""

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import scipy.stats

from xsa_lm.errors import UserError

LOG_CAP = math.log(1e6)  # log multipliers are capped here: XSA's loss below the fitted floor E has no finite k
MIN_BOOTSTRAP_SEEDS = 3
FORMS = {"power_law_offset": 3, "power_law": 2}  # fit form -> its number of parameters


@dataclass
class Fit:
    form: str  # power_law_offset: E + A C^-alpha; power_law: A C^-alpha
    E: float
    A: float  # for C in units of c_ref (numerically tame): L = E + A (C / c_ref)^-alpha
    alpha: float
    c_ref: float
    residuals: list[float]  # observed - fitted, per point

    def loss(self, compute: float) -> float:
        return self.E + self.A * (compute / self.c_ref) ** -self.alpha

    def compute_for(self, loss: float) -> float:
        """The compute at which the fit reaches `loss`: inf when loss is at or below the floor E."""
        if loss <= self.E:
            return math.inf
        return self.c_ref * (self.A / (loss - self.E)) ** (1 / self.alpha)

    def describe(self) -> str:
        head = f"L(C) = {self.E:.4f} + " if self.form == "power_law_offset" else "L(C) = "
        return head + f"{self.A * self.c_ref**self.alpha:.4g} * C^-{self.alpha:.4f}"

    def as_dict(self) -> dict:
        return {
            "form": self.form,
            "formula": self.describe(),
            "E": self.E,
            "A": self.A * self.c_ref**self.alpha,  # for C in FLOPs
            "alpha": self.alpha,
            "residuals": self.residuals,
            "rms_residual": math.sqrt(sum(r * r for r in self.residuals) / len(self.residuals)),
            "points": len(self.residuals),
            "parameters": FORMS[self.form],
        }


def choose_form(n_points: int, form: str = "auto") -> str:
    """`auto`: the offset form when the points leave it at least one residual degree of freedom, else the pure power
    law. A form with more parameters than points is refused."""
    if form == "auto":
        form = "power_law_offset" if n_points > FORMS["power_law_offset"] else "power_law"
    if form not in FORMS:
        raise UserError(f"scale.fit={form!r}: choose auto, power_law or power_law_offset")
    if n_points < FORMS[form]:
        raise UserError(
            f"the {form} fit has {FORMS[form]} parameters but only {n_points} size(s) have SA results: "
            "add model sizes (scale.models) or choose a fit with fewer terms (scale.fit=power_law)"
        )
    return form


def _least_squares(x: np.ndarray, y: np.ndarray, form: str, a0: float, alpha0: float) -> tuple[float, float, float]:
    """(E, a, alpha) of the form in loss space, x being compute over its reference."""
    if form == "power_law":
        (a, alpha), _ = scipy.optimize.curve_fit(
            lambda x, a, alpha: a * x**-alpha, x, y, p0=(a0, alpha0), bounds=((0, 0), (np.inf, 10))
        )
        return 0.0, a, alpha
    floor = float(y.min())  # E stays below every observed loss
    (E, a, alpha), _ = scipy.optimize.curve_fit(
        lambda x, E, a, alpha: E + a * x**-alpha,
        x,
        y,
        p0=(0.5 * floor, max(a0 - 0.5 * floor, 1e-3), alpha0),
        bounds=((0, 0, 0), (floor, np.inf, 10)),
        maxfev=20000,
    )
    return E, a, alpha


def fit_loss_vs_compute(compute: Sequence[float], loss: Sequence[float], form: str = "auto") -> Fit:
    """Least squares in loss (scipy.optimize.curve_fit), started from the log-log line through the points."""
    form = choose_form(len(compute), form)
    c = np.asarray(compute, dtype=float)
    y = np.asarray(loss, dtype=float)
    c_ref = float(np.exp(np.mean(np.log(c))))
    x = c / c_ref
    slope, intercept, *_ = scipy.stats.linregress(np.log(x), np.log(y))
    with warnings.catch_warnings():  # an exact fit has no covariance estimate; only the parameters are used
        warnings.simplefilter("ignore", scipy.optimize.OptimizeWarning)
        E, a, alpha = _least_squares(x, y, form, a0=math.exp(intercept), alpha0=max(-slope, 1e-3))
    fit = Fit(form=form, E=float(E), A=float(a), alpha=float(alpha), c_ref=c_ref, residuals=[])
    fit.residuals = [float(yi - fit.loss(ci)) for ci, yi in zip(c, y, strict=True)]
    return fit


def multiplier(fit: Fit, sa_loss: float, xsa_loss: float) -> float:
    """XSA's effective-compute multiplier at one size (see the module docstring); inf when XSA's loss is at or
    below the fit's floor."""
    return fit.compute_for(xsa_loss) / fit.compute_for(sa_loss)


def multiplier_interval(fit: Fit, sa_loss: float, diff_ci: Sequence[float]) -> tuple[float, float]:
    """The 95% interval of the multiplier from the paired t interval of XSA - SA at this size, each end converted to
    compute through the SA fit (k falls as XSA's loss rises). Exact for normal seed noise with the fit's exchange rate
    held fixed: measured on synthetic data, 95% coverage with 4 sizes (the offset fit), 90-93% with 3 (a pure power law
    where the truth has an offset)."""
    lo, hi = diff_ci
    return multiplier(fit, sa_loss, sa_loss + hi), multiplier(fit, sa_loss, sa_loss + lo)


def multipliers(compute: Sequence[float], sa: Sequence[float], xsa: Sequence[float], form: str = "auto") -> list[float]:
    """The SA fit through (compute, sa) and XSA's multiplier at every size."""
    fit = fit_loss_vs_compute(compute, sa, form)
    return [multiplier(fit, s, x) for s, x in zip(sa, xsa, strict=True)]


def bootstrap_multipliers(
    compute: Sequence[float],
    sa_runs: Sequence[Sequence[float]],
    xsa_runs: Sequence[Sequence[float]],
    form: str = "auto",
    n_resamples: int = 1000,
    seed: int = 0,
) -> list[tuple[float, float] | None]:
    """95% percentile-bootstrap interval of each size's multiplier, the fit's own uncertainty included. One resample
    draws, independently per size, the
    seeds with replacement (an SA and an XSA run of the same seed stay together), refits SA and recomputes every
    multiplier, so the interval carries both the seed noise at that size and the fit's. scipy.stats.bootstrap does
    the resampling. Fewer than MIN_BOOTSTRAP_SEEDS seeds at any size: None (2 seeds have only 3 distinct
    resamples). An upper end of inf (unbounded) when more than 2.5% of the resamples put XSA at or below the fitted
    floor. With few seeds it is too narrow: measured on synthetic data, 76% coverage at 4 seeds per size and 90% at
    8 (BCa no better); multiplier_interval is the calibrated one."""
    sizes = len(compute)
    if any(len(s) != len(x) for s, x in zip(sa_runs, xsa_runs, strict=True)):
        raise ValueError("sa_runs and xsa_runs need the same seeds at each size")
    if any(len(s) < MIN_BOOTSTRAP_SEEDS for s in sa_runs):
        return [None] * sizes
    fixed_form = choose_form(sizes, form)

    def statistic(*seed_indices: np.ndarray) -> np.ndarray:
        sa = [float(np.mean(np.take(s, i.astype(int)))) for s, i in zip(sa_runs, seed_indices, strict=True)]
        xsa = [float(np.mean(np.take(x, i.astype(int)))) for x, i in zip(xsa_runs, seed_indices, strict=True)]
        try:
            ks = multipliers(compute, sa, xsa, fixed_form)
        except RuntimeError:  # curve_fit found no optimum for this resample: no information on any size
            return np.full(sizes, np.nan)
        return np.array([min(math.log(k), LOG_CAP) if k > 0 else -LOG_CAP for k in ks])

    samples = tuple(np.arange(len(s), dtype=float) for s in sa_runs)
    result = scipy.stats.bootstrap(
        samples,
        statistic,
        n_resamples=n_resamples,
        vectorized=False,
        paired=False,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    intervals: list[tuple[float, float] | None] = []
    for lo, hi in zip(result.confidence_interval.low, result.confidence_interval.high, strict=True):
        if not (math.isfinite(lo) and math.isfinite(hi)):
            intervals.append(None)
        else:
            intervals.append((math.exp(lo), math.inf if hi >= LOG_CAP else math.exp(hi)))
    return intervals


def wallclock_multiplier(k: float, sa_tokens_per_s: float | None, xsa_tokens_per_s: float | None) -> float | None:
    """The multiplier in wall-clock time: k x XSA's throughput over SA's (a slower XSA gives back part of k)."""
    if not sa_tokens_per_s or not xsa_tokens_per_s:
        return None
    return k * xsa_tokens_per_s / sa_tokens_per_s
