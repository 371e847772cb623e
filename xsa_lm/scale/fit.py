"""Loss vs training compute, and a candidate arm's effective-compute multiplier over the baseline (by default XSA's
over SA's), as pure functions.

- The baseline fit, L(C) = E + A C^-alpha through the baseline's mean losses (E = 0 below 4 sizes), least squares in
  loss: what the lack-of-fit test and the extrapolation check judge.
- The shared fit, L_arm(C) = E + A_arm C^-alpha (one E, one alpha), Huber loss on log-loss residuals: k = (A_baseline /
  A_candidate)^(1/alpha), the compute the baseline needs to match the candidate (OLMo-core's ladder), with a 95%
  interval from a bootstrap over seeds that keeps each seed's runs of both arms together (a paired t interval through
  a fixed baseline curve undercovers: tests/test_scale.py measures it)."""

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import scipy.stats

from xsa_lm.errors import UserError
from xsa_lm.records import JsonObject

LOG_CAP = math.log(1e6)  # log multipliers are capped here: an alpha near 0 puts k out of any reading
FORMS = {"power_law_offset": 3, "power_law": 2}  # fit form -> its number of parameters (SA fit)
ALPHA_MAX = 2.0  # language-model loss exponents are 0.05-0.5; the bound keeps a degenerate fit finite
HUBER_DEFAULT = 1e-3  # Chinchilla's delta on log-loss residuals, when the seed noise is unknown
LOG_A_MAX = 50.0  # ln A (C in units of its geometric mean) stays finite in every refit
BOUND_TOLERANCE = 1e-3  # a parameter within this fraction of its range from a bound sits at that bound


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
        if loss <= self.E or self.alpha <= 0:
            return math.inf
        return self.c_ref * (self.A / (loss - self.E)) ** (1 / self.alpha)

    def as_dict(self) -> JsonObject:
        A = self.A * self.c_ref**self.alpha  # for C in FLOPs
        head = f"L(C) = {self.E:.4f} + " if self.form == "power_law_offset" else "L(C) = "
        return {
            "form": self.form,
            "formula": f"{head}{A:.4g} * C^-{self.alpha:.4f}",
            "E": self.E,
            "A": A,
            "alpha": self.alpha,
            "residuals": self.residuals,
            "rms_residual": math.sqrt(sum(r * r for r in self.residuals) / len(self.residuals)),
            "points": len(self.residuals),
            "parameters": FORMS[self.form],
        }


def choose_form(n_points: int, form: str = "auto") -> str:
    """`auto`: the offset form when the points leave it a residual degree of freedom, else the pure power law."""
    if form == "auto":
        form = "power_law_offset" if n_points > FORMS["power_law_offset"] else "power_law"
    if n_points < FORMS[form]:
        raise UserError(
            f"the {form} fit has {FORMS[form]} parameters but only {n_points} size(s) have results: "
            "add model sizes (scale.models) or choose a fit with fewer terms (scale.fit=power_law)"
        )
    return form


def fit_loss_vs_compute(compute: Sequence[float], loss: Sequence[float], form: str = "auto") -> Fit:
    """The baseline fit: least squares in loss (scipy.optimize.curve_fit), started from the log-log line."""
    form = choose_form(len(compute), form)
    c = np.asarray(compute, dtype=float)
    y = np.asarray(loss, dtype=float)
    c_ref = float(np.exp(np.mean(np.log(c))))
    x = c / c_ref
    slope, intercept, *_ = scipy.stats.linregress(np.log(x), np.log(y))
    a0, alpha0, floor = math.exp(intercept), max(-slope, 1e-3), float(y.min())
    offset = form == "power_law_offset"  # E + a x^-alpha with E in [0, the lowest loss]; else a x^-alpha
    p0 = [0.5 * floor, max(a0 - 0.5 * floor, 1e-3), alpha0] if offset else [a0, alpha0]
    bounds = ([0.0] * len(p0), [floor, np.inf, 10.0][-len(p0) :])
    with warnings.catch_warnings():  # an exact fit has no covariance estimate; only the parameters are used
        warnings.simplefilter("ignore", scipy.optimize.OptimizeWarning)
        p, _ = scipy.optimize.curve_fit(
            lambda x, *q: (q[0] if offset else 0.0) + q[-2] * x ** -q[-1], x, y, p0=p0, bounds=bounds, maxfev=20000
        )
    E, a, alpha = p if offset else (0.0, *p)
    fit = Fit(form=form, E=float(E), A=float(a), alpha=float(alpha), c_ref=c_ref, residuals=[])
    fit.residuals = [float(yi - fit.loss(ci)) for ci, yi in zip(c, y, strict=True)]
    return fit


@dataclass(frozen=True)
class LackOfFit:
    """The chi^2 test of a fit against the seed noise of its points."""

    chi2: float | None
    dof: int
    p: float | None


def lack_of_fit(residuals: Sequence[float], standard_errors: Sequence[float], parameters: int) -> LackOfFit:
    """chi^2 = sum((residual / SE)^2) on points - parameters dof, and its p; None without a dof or a positive SE."""
    dof = len(residuals) - parameters
    se = np.asarray(standard_errors, dtype=float)
    if dof <= 0 or not np.all(np.isfinite(se)) or np.any(se <= 0):
        return LackOfFit(chi2=None, dof=dof, p=None)
    chi2 = float(np.sum((np.asarray(residuals) / se) ** 2))
    return LackOfFit(chi2=chi2, dof=dof, p=float(scipy.stats.chi2.sf(chi2, dof)))


@dataclass
class SharedFit:
    """L_arm(C) = E + A_arm (C / c_ref)^-alpha for the baseline and the candidate arm, one E and one alpha."""

    offset: bool  # False: E = 0 (a pure power law)
    E: float
    log_A_baseline: float  # ln A for C in units of c_ref
    log_A_candidate: float
    alpha: float
    c_ref: float
    floor: float  # E's upper bound: the lowest observed mean
    residuals: list[float]  # observed - fitted in loss, the baseline's sizes then the candidate's

    def loss(self, compute: np.ndarray | float, candidate: bool = False) -> np.ndarray:
        log_A = self.log_A_candidate if candidate else self.log_A_baseline
        return self.E + np.exp(log_A - self.alpha * np.log(np.asarray(compute) / self.c_ref))

    @property
    def log_multiplier(self) -> float:
        """ln k = ln(A_baseline / A_candidate) / alpha, capped at +-LOG_CAP."""
        gap = self.log_A_baseline - self.log_A_candidate
        if self.alpha <= 0:
            return math.copysign(LOG_CAP, gap)
        return max(-LOG_CAP, min(LOG_CAP, gap / self.alpha))

    @property
    def multiplier(self) -> float:
        return math.exp(self.log_multiplier)

    @property
    def parameters(self) -> int:
        return 4 if self.offset else 3

    def at_bounds(self) -> list[str]:
        """The parameters sitting at a bound of the fit (not identified by the data)."""
        found = []
        if self.offset and self.E <= BOUND_TOLERANCE * self.floor:
            found.append(f"E = {self.E:.4f} at its lower bound 0")
        if self.offset and self.E >= (1 - BOUND_TOLERANCE) * self.floor:
            found.append(f"E = {self.E:.4f} at its upper bound, the lowest mean loss {self.floor:.4f}")
        if self.alpha <= BOUND_TOLERANCE * ALPHA_MAX:
            found.append(f"alpha = {self.alpha:.4f} at its lower bound 0")
        if self.alpha >= (1 - BOUND_TOLERANCE) * ALPHA_MAX:
            found.append(f"alpha = {self.alpha:.4f} at its upper bound {ALPHA_MAX}")
        return found

    def as_dict(self, labels: tuple[str, str] = ("SA", "XSA")) -> JsonObject:
        """`labels`: the baseline's and the candidate's in the formula."""
        to_flops = self.alpha * math.log(self.c_ref)  # ln A for C in FLOPs, not in units of c_ref
        A = [math.exp(log_A + to_flops) for log_A in (self.log_A_baseline, self.log_A_candidate)]
        head = f"L(C) = {self.E:.4f} + " if self.offset else "L(C) = "
        return {
            "formula": f"{head}{{{labels[0]}: {A[0]:.4g}, {labels[1]}: {A[1]:.4g}}} * C^-{self.alpha:.4f}",
            "E": self.E,
            "A_baseline": A[0],
            "A_candidate": A[1],
            "alpha": self.alpha,
            "residuals": self.residuals,
            "points": len(self.residuals),
            "parameters": self.parameters,
            "loss": "huber on log-loss residuals",
        }


def huber_scale(means: Sequence[float], standard_errors: Sequence[float]) -> float:
    """Huber's delta on log-loss residuals: 1.345 x the median relative seed noise, else HUBER_DEFAULT."""
    relative = [se / m for se, m in zip(standard_errors, means, strict=True) if math.isfinite(se) and se > 0]
    return 1.345 * float(np.median(relative)) if relative else HUBER_DEFAULT


def _starts(x: np.ndarray, y: np.ndarray, offset: bool, floor: float) -> list[np.ndarray]:
    """A grid of starting points: E and alpha on a grid, each arm's a from the log-log line given them."""
    n = len(x) // 2
    starts = []
    for E in (0.0, 0.5 * floor, 0.9 * floor) if offset else (0.0,):
        for alpha in (0.05, 0.2, 0.6):
            a = [float(np.mean(np.log(y[s] - E) + alpha * np.log(x[s]))) for s in (slice(0, n), slice(n, None))]
            starts.append(np.array(([E] if offset else []) + a + [alpha]))
    return starts


def fit_shared(
    compute: Sequence[float],
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    offset: bool,
    f_scale: float = HUBER_DEFAULT,
    start: np.ndarray | None = None,
) -> SharedFit:
    """The shared fit (least_squares, Huber on log-loss residuals): the best of a grid of starts, or `start`'s."""
    c = np.asarray(compute, dtype=float)
    c_ref = float(np.exp(np.mean(np.log(c))))
    x = np.r_[c, c] / c_ref
    y = np.r_[np.asarray(baseline, dtype=float), np.asarray(candidate, dtype=float)]
    floor = float(y.min())
    # the baseline's sizes, then the candidate's
    log_x, log_y, of_candidate = np.log(x), np.log(y), np.arange(len(x)) >= len(c)

    def residuals(p: np.ndarray) -> np.ndarray:  # ln y - ln(E + exp(a_arm) x^-alpha) of p = [E,] a_base, a_cand, alpha
        E, (a_base, a_cand, alpha) = p[0] if offset else 0.0, p[-3:]
        with np.errstate(over="ignore"):  # a trial step far off: an infinite residual, which the solver rejects
            return log_y - np.log(E + np.exp(np.where(of_candidate, a_cand, a_base) - alpha * log_x))

    lower = ([0.0] if offset else []) + [-LOG_A_MAX, -LOG_A_MAX, 0.0]
    upper = ([floor] if offset else []) + [LOG_A_MAX, LOG_A_MAX, ALPHA_MAX]
    tol = 1e-8 if start is None else 1e-6  # a refit moves ln k by far more than 1e-6 between resamples
    fits = (
        scipy.optimize.least_squares(
            residuals,
            np.clip(p0, lower, upper),
            bounds=(lower, upper),
            loss="huber",
            f_scale=f_scale,
            x_scale="jac",  # E, ln A and alpha differ in scale by orders: 3-10x fewer evaluations
            ftol=tol,
            xtol=tol,
            gtol=tol,
        )
        for p0 in (_starts(x, y, offset, floor) if start is None else [start])
    )
    p = min(fits, key=lambda result: result.cost).x
    E = float(p[0]) if offset else 0.0
    fit = SharedFit(offset, E, float(p[-3]), float(p[-2]), float(p[-1]), c_ref, floor, residuals=[])
    fitted = np.r_[fit.loss(c), fit.loss(c, candidate=True)]
    fit.residuals = [float(r) for r in y - fitted]
    return fit


def lack_of_fit_variance(residuals: Sequence[float], standard_errors: Sequence[float], parameters: int) -> float:
    """The variance of the means about the curve beyond their seed noise, sum(r^2) / dof - mean(SE^2), floored at 0."""
    dof = len(residuals) - parameters
    if dof <= 0:
        return 0.0
    excess = float(np.sum(np.square(residuals))) / dof - float(np.mean(np.square(standard_errors)))
    return max(0.0, excess)


def ladder_bootstrap(
    fit: SharedFit,
    compute: Sequence[float],
    baseline_runs: np.ndarray,
    candidate_runs: np.ndarray,
    *,
    lof_variance: float,
    f_scale: float,
    n_resamples: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """95% interval of the ladder's k. `*_runs[i, s]`: the final loss of seed s at size i (NaN: no pair there). Each
    resample draws seeds with replacement, each seed's losses of both arms at every size together (they share the
    initialisation and data order), takes each size's means, adds the size-level deviation beyond seed noise
    (lof_variance) and refits; the basic interval in ln k, [2 ln k - q97.5, 2 ln k - q2.5], corrects bias."""
    rng = np.random.default_rng(seed)
    runs = np.stack([baseline_runs, candidate_runs])  # arm, size, seed
    present = ~np.isnan(runs)
    losses = np.nan_to_num(runs)
    arms = [fit.log_A_baseline, fit.log_A_candidate]
    start = np.array(([fit.E] if fit.offset else []) + arms + [fit.alpha])  # as fit_shared has it
    n, seeds = runs.shape[1:]
    logs = []
    for _ in range(n_resamples):
        weight = np.bincount(rng.integers(0, seeds, seeds), minlength=seeds)  # how often each seed was drawn
        counted = (present * weight).sum(axis=2)
        if np.any(counted == 0):  # a size with none of the drawn seeds
            continue
        y = ((losses * weight).sum(axis=2) / counted).ravel() + rng.normal(0.0, math.sqrt(lof_variance), 2 * n)
        if np.any(y <= 0):
            continue
        refit = fit_shared(compute, list(y[:n]), list(y[n:]), offset=fit.offset, f_scale=f_scale, start=start)
        logs.append(refit.log_multiplier)
    q_lo, q_hi = np.percentile(logs, [2.5, 97.5])
    log_k = fit.log_multiplier
    lo, hi = (float(np.clip(2 * log_k - q, -LOG_CAP, LOG_CAP)) for q in (q_hi, q_lo))
    return math.exp(lo), math.exp(hi)
