"""SA vs XSA per size and across sizes, with tests that fit toy-scale outcomes: some SA seeds stall on a plateau, so
the paired differences are bimodal and a t test alone can mislead. Per size: the paired t, the exact Wilcoxon
signed-rank test and the exact sign test; across sizes: Holm's adjustment of the per-size t p-values and one sign
test over every pair of every size."""

from collections.abc import Sequence

import numpy as np
import scipy.stats


def size_tests(sa: Sequence[float], xsa: Sequence[float]) -> dict:
    """XSA - SA at one size over paired seeds: its mean, the paired t (p and 95% interval), the exact Wilcoxon
    signed-rank p and the exact sign-test p (two-sided; pairs with no difference left out). None where a test needs
    more pairs than there are."""
    diff = np.asarray(xsa, dtype=float) - np.asarray(sa, dtype=float)
    out: dict = {"pairs": len(diff), "mean_diff": float(diff.mean()) if len(diff) else None}
    out |= {"t_p": None, "t_ci95": None, "wilcoxon_p": None, "sign_p": None}
    nonzero = diff[diff != 0]
    out["xsa_lower"] = int(np.sum(diff < 0))
    if len(diff) >= 2 and np.std(diff) > 0:
        t = scipy.stats.ttest_1samp(diff, 0.0)
        ci = t.confidence_interval(0.95)
        out["t_p"], out["t_ci95"] = float(t.pvalue), [float(ci.low), float(ci.high)]
    if len(nonzero) >= 1:
        out["wilcoxon_p"] = float(scipy.stats.wilcoxon(nonzero, method="exact").pvalue)
        out["sign_p"] = float(scipy.stats.binomtest(out["xsa_lower"], len(nonzero)).pvalue)
    return out


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment (family-wise error), by hand because scipy.stats.false_discovery_control does
    Benjamini-Hochberg (false discovery rate) only. None stays None and does not count in the family."""
    known = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    adjusted: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(known):
        running = max(running, min(1.0, (len(known) - rank) * p))
        adjusted[i] = running
    return adjusted


def pooled_sign_test(pairs: Sequence[tuple[Sequence[float], Sequence[float]]]) -> dict:
    """One exact sign test over every (SA, XSA) pair of every size: how often XSA is lower, and its two-sided p."""
    diffs = np.concatenate([np.asarray(x, dtype=float) - np.asarray(s, dtype=float) for s, x in pairs])
    nonzero = diffs[diffs != 0]
    lower = int(np.sum(nonzero < 0))
    p = float(scipy.stats.binomtest(lower, len(nonzero)).pvalue) if len(nonzero) else None
    return {"pairs": len(diffs), "xsa_lower": lower, "p": p}
