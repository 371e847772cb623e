"""What a comparison may claim: a verdict against the plan's practical margin, tests over pairs that share a seed (each
seed's mean difference is one draw), the claim rate on an A/A null, and stall rates with exact and stratified tests."""

import itertools
import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats

from xsa_lm.records import Record
from xsa_lm.stats.paired import ALPHA, POWER, paired_t, sign_test_p


def exact_interval(k: int, n: int) -> tuple[float, float]:
    """The exact (Clopper-Pearson) 95% interval of a rate of k in n."""
    ci = scipy.stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return float(ci.low), float(ci.high)


@dataclass(frozen=True, kw_only=True)
class MantelHaenszel(Record):
    statistic: float | None
    p_value: float | None
    excess_sa_stalls: float | None = None  # observed - expected SA stalls, summed over the tables
    note: str | None = None  # why there is no test


def mantel_haenszel(tables: Sequence[tuple[int, int, int, int]]) -> MantelHaenszel:
    """The continuity-corrected Cochran-Mantel-Haenszel test (scipy has none) of 2x2 tables (SA stalled, SA not, XSA
    stalled, XSA not), one per LR: is SA's stall rate XSA's at every LR?"""
    deviation = variance = 0.0
    for a, b, c, d in tables:
        n = a + b + c + d
        if n < 2:
            continue
        deviation += a - (a + b) * (a + c) / n
        variance += (a + b) * (c + d) * (a + c) * (b + d) / (n * n * (n - 1))
    if variance == 0:
        note = "no stall at any LR, or every run stalled: nothing to test"
        return MantelHaenszel(statistic=None, p_value=None, note=note)
    statistic = (abs(deviation) - 0.5) ** 2 / variance if abs(deviation) > 0.5 else 0.0
    p = float(scipy.stats.chi2.sf(statistic, 1))
    return MantelHaenszel(statistic=statistic, p_value=p, excess_sa_stalls=deviation)


VERDICTS = ("better", "not worse", "worse", "inconclusive")


@dataclass(frozen=True, kw_only=True)
class MarginVerdict(Record):
    """XSA - SA against the declared margin, from the one-sided (1 - ALPHA) bounds of Student's paired t."""

    margin: float
    lower: float | None  # the one-sided 95% lower bound of the mean difference (the 90% two-sided interval's end)
    upper: float | None
    verdict: str  # one of VERDICTS
    why: str


def margin_verdict(diffs: Sequence[float], margin: float, arm: str = "XSA") -> MarginVerdict:
    """The verdict on the paired differences `arm` - baseline (XSA - SA) against `margin` >= 0 nats, from the one-sided
    95% bounds: better (upper < -margin), worse (lower > margin), not worse (upper < margin: non-inferior), else
    inconclusive."""
    ci = paired_t(diffs, confidence=1 - 2 * ALPHA).ci  # its ends are the one-sided bounds at level ALPHA
    if ci is None:
        why = "fewer than 2 pairs, or differences with no spread: no interval, so no claim either way"
        return MarginVerdict(margin=margin, lower=None, upper=None, verdict="inconclusive", why=why)
    lower, upper = ci
    bounds = f"one-sided {1 - ALPHA:.0%} bounds [{lower:+.4f}, {upper:+.4f}] against the margin {margin:g}"
    if upper < -margin:
        verdict, why = "better", f"{arm} is lower by more than the margin: {bounds}"
    elif lower > margin:
        verdict, why = "worse", f"{arm} is higher by more than the margin: {bounds}"
    elif upper < margin:
        verdict, why = "not worse", f"{arm} is no worse than the margin, and not shown better by more than it: {bounds}"
    else:
        verdict, why = "inconclusive", f"the interval reaches past the margin: {bounds}; more seeds decide"
    return MarginVerdict(margin=margin, lower=lower, upper=upper, verdict=verdict, why=why)


@dataclass(frozen=True, kw_only=True)
class ClusteredTest(Record):
    """Paired differences grouped by the seed they share: the tests run on one mean difference per seed."""

    pairs: int
    clusters: int  # seeds
    cluster_means: list[float]  # the mean XSA - SA of each seed, in the order the seeds first appear
    xsa_lower: int  # seeds whose mean difference is negative
    sign_flip_p: float | None  # exact (up to 2^16 clusters' flips) two-sided permutation p of the mean
    sign_p: float | None  # the exact sign test over the seeds
    naive_sign_p: float | None  # the sign test as if every pair were independent: for comparison only


def clustered_test(diffs: Sequence[float], clusters: Sequence[Hashable]) -> ClusteredTest:
    """The sign test and the permutation test that flips whole clusters (seeds), on each cluster's mean difference."""
    groups: dict[Hashable, list[float]] = {}
    for d, c in zip(diffs, clusters, strict=True):
        groups.setdefault(c, []).append(float(d))
    means = [float(np.mean(v)) for v in groups.values()]
    flip_p = None
    if len(means) == 1 and means[0] != 0:
        flip_p = 1.0  # both signs of one mean are as extreme: the exact answer, which scipy refuses to compute
    elif any(m != 0 for m in means):
        test = scipy.stats.permutation_test(  # two-sided, exact up to 16 seeds
            (np.asarray(means),), np.mean, permutation_type="samples", n_resamples=2**16, random_state=0
        )
        flip_p = float(test.pvalue)
    return ClusteredTest(
        pairs=len(diffs),
        clusters=len(means),
        cluster_means=means,
        xsa_lower=sum(m < 0 for m in means),
        sign_flip_p=flip_p,
        sign_p=sign_test_p(means),
        naive_sign_p=sign_test_p(list(diffs)),
    )


@dataclass(frozen=True, kw_only=True)
class NullRates(Record):
    """How often studies of `study_size` null pairs claim an effect (null_rates). The studies of every subset overlap:
    their shares are descriptive, without an interval; the disjoint studies' claims carry the exact interval."""

    pairs: int
    study_size: int
    margin: float
    sd_diff: float
    studies: int  # the subsets counted: every one of C(pairs, study_size) when `exact`, else a random draw of them
    exact: bool
    ci_excludes_0: float  # the share of studies whose two-sided 95% t interval excludes 0
    verdict_claims_effect: float  # the share whose margin verdict is better or worse
    nominal_claims: float  # the verdict's claim rate under normal noise of sd sd_diff (nominal_claim_rate)
    disjoint_studies: int
    disjoint_claims: int
    disjoint_claims_ci95: list[float]
    detectable_rate: float  # the smallest true claim rate the disjoint studies tell from 5% (detectable_rate)


EXACT_STUDIES = 3_000_000  # every subset up to here (C(24, 12) = 2,704,156 takes seconds); above, a random draw
DRAWN_STUDIES = 100_000
CHUNK = 50_000  # subsets per array: memory stays at a few MB whatever the count


def study_subsets(pairs: int, size: int) -> Iterator[np.ndarray]:
    """Index arrays (rows: studies) of every `size`-subset of range(pairs), in chunks, or of DRAWN_STUDIES random ones
    above EXACT_STUDIES subsets (numpy enumerates no combinations)."""
    if math.comb(pairs, size) <= EXACT_STUDIES:
        combos = itertools.combinations(range(pairs), size)
        while (chunk := np.fromiter(itertools.chain.from_iterable(itertools.islice(combos, CHUNK)), np.intp)).size:
            yield chunk.reshape(-1, size)
        return
    rng = np.random.default_rng(0)
    for start in range(0, DRAWN_STUDIES, CHUNK):
        yield rng.random((min(CHUNK, DRAWN_STUDIES - start), pairs)).argsort(axis=1)[:, :size]


def nominal_claim_rate(margin: float, sd: float, n: int) -> float:
    """The margin verdict's claim rate (better or worse) on n normal differences of mean 0 and sd `sd`: it claims
    better when (mean + margin) / se < -t_{1-ALPHA, n-1}, a noncentral t of delta = margin sqrt(n) / sd; worse alike."""
    if sd <= 0:
        return 0.0
    t = scipy.stats.t.ppf(1 - ALPHA, n - 1)
    # P(T_delta < -t) as P(T_-delta > t): scipy's cdf returns nan for a large delta, its sf 0
    return float(2 * scipy.stats.nct.sf(t, n - 1, -margin * math.sqrt(n) / sd))


def detectable_rate(studies: int) -> float:
    """The smallest true claim rate that `studies` disjoint studies tell from ALPHA with POWER: the one-sided exact
    binomial test at ALPHA rejects from c claims (the fewest with P(X >= c | ALPHA) <= ALPHA), and P(X >= c | p) is
    the Beta(c, studies - c + 1) distribution function at p, so p is its POWER quantile."""
    c = next(c for c in range(studies + 1) if scipy.stats.binom.sf(c - 1, studies, ALPHA) <= ALPHA)
    return float(scipy.stats.beta.ppf(POWER, c, studies - c + 1))


def null_rates(diffs: Sequence[float], study_size: int, margin: float) -> NullRates | None:
    """How often the procedure claims an effect on A/A null differences: over every study of `study_size` pairs (or
    a random draw, study_subsets) the shares whose t interval excludes 0 and whose margin verdict claims one; over
    disjoint studies the claims, with an exact CI and the rate they could tell from 5%. None below 2 x study_size."""
    values = np.asarray(diffs, dtype=float)
    n = values.size
    if study_size < 2 or n < 2 * study_size:
        return None
    two_sided, one_sided = scipy.stats.t.ppf([1 - ALPHA / 2, 1 - ALPHA], study_size - 1)
    studies = excludes = claims = 0
    for picks in study_subsets(n, study_size):
        chosen = values[picks]
        mean, se = chosen.mean(axis=1), chosen.std(axis=1, ddof=1) / math.sqrt(study_size)
        spread = se > 1e-12 * np.maximum(1.0, np.abs(chosen).max(axis=1))  # no spread: no interval, no claim
        studies += len(chosen)
        excludes += int((spread & (np.abs(mean) > two_sided * se)).sum())
        claims += int((spread & ((mean + one_sided * se < -margin) | (mean - one_sided * se > margin))).sum())
    disjoint = values[: n // study_size * study_size].reshape(-1, study_size)
    disjoint_claims = sum(margin_verdict(study.tolist(), margin).verdict in ("better", "worse") for study in disjoint)
    sd = float(np.std(values, ddof=1))
    return NullRates(
        pairs=int(n),
        study_size=study_size,
        margin=margin,
        sd_diff=sd,
        studies=studies,
        exact=studies == math.comb(n, study_size),
        ci_excludes_0=excludes / studies,
        verdict_claims_effect=claims / studies,
        nominal_claims=nominal_claim_rate(margin, sd, study_size),
        disjoint_studies=len(disjoint),
        disjoint_claims=int(disjoint_claims),
        disjoint_claims_ci95=list(exact_interval(int(disjoint_claims), len(disjoint))),
        detectable_rate=detectable_rate(len(disjoint)),
    )


def null_study_sizes(pairs: int) -> list[int]:
    """3 (the paper sweep's compare seeds), 5 (the token axis's) and half the pairs: two disjoint studies each."""
    return sorted({size for size in (3, 5, pairs // 2) if 2 <= size <= pairs // 2})
