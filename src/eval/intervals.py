"""Intervals and tests that hold at the sample sizes a device lease affords (the gate's, src/gate.py).

Non-inferiority of paired binary outcomes: does the routed session lose at most a margin of accuracy against the
all-re-prefill session on the same items?

Per item the native (all-re-prefill) answer and the routed answer are each right or wrong; only the discordant items
carry information: `lost` (native right, routed wrong) and `gained` (routed right, native wrong) of `n`. The loss is
(lost − gained) / n. A percentile bootstrap of that difference collapses to [0, 0] when no item differs and covers far
less than 95 % at the sample sizes a device lease affords, so the gate decides with:

- the exact unconditional test at the margin (Sidik 2003, with Tango's score as its ordering): its false-PASS rate at a
  true loss of exactly the margin is at most α at every n and every discordance, by construction;
- Tango's score interval (Tango 1998) to show where the loss lies;
- for turns clustered in conversations, Tango's score on counts divided by the design effect (Rao & Scott 1992);
- Nam's sample size (Nam 1997) for the items a decision needs at a stated true loss;
- over tasks, the mean with an interval recovered from the tasks' (Zou & Donner 2008).

A median (a speedup, the harness's same-work ratio) gets the distribution-free order-statistic interval, exact for
independent values at any n; a ratio of medians timed apart (not paired) gets one from each median's (Bonferroni).

Every function is pure; counts may be non-integers (effective counts of clustered turns). Losses are fractions here
(0.01 = 1 point); the gate converts.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy.special import gammaln
from scipy.stats import binom, norm

NUISANCE_GRID = 300  # values of the nuisance P(gained) the exact test's supremum is taken over (√-spaced)


def restricted_gained(lost, gained, n, loss):
    """The ML estimate of P(gained) under H0: P(lost) − P(gained) = loss (Tango 1998, Eqs. 25–26). Arrays broadcast."""
    a = 2 * n
    b = -lost - gained + (2 * n - lost + gained) * loss
    c = -gained * loss * (1 - loss)
    return (np.sqrt(np.maximum(b * b - 4 * a * c, 0.0)) - b) / (2 * a)


def tango_score(lost, gained, n, loss):
    """Tango's score statistic for H0: P(lost) − P(gained) = loss (Tango 1998, Eq. 24); decreasing in `loss`. Where its
    variance vanishes (loss 0, no discordant item) it is 0: nothing departs from H0. Arrays broadcast."""
    variance = n * (2 * restricted_gained(lost, gained, n, loss) + loss * (1 - loss))
    with np.errstate(divide="ignore", invalid="ignore"):
        score = (lost - gained - n * loss) / np.sqrt(variance)
    return np.nan_to_num(score, nan=0.0, posinf=np.inf, neginf=-np.inf)


def _bound(lost: float, gained: float, n: float, z: float, upper: bool) -> float:
    """Where Tango's score crosses ∓z, by bisection between the estimate and ±1 (60 halvings: below 1e-17)."""
    low, high = ((lost - gained) / n, 1.0) if upper else (-1.0, (lost - gained) / n)
    for _ in range(60):
        middle = (low + high) / 2
        inside = tango_score(lost, gained, n, middle) > -z if upper else tango_score(lost, gained, n, middle) < z
        low, high = (middle, high) if inside == upper else (low, middle)
    return (low + high) / 2


def tango_interval(lost: float, gained: float, n: float, level: float = 0.95) -> tuple[float, float]:
    """Tango's score interval for P(lost) − P(gained) (Tango 1998, Stat Med 17:891: the loss values its score test at `level`
    does not reject). Matches PropCIs::scoreci.mp(gained, lost, n)."""
    if not (n > 0 and 0 <= lost and 0 <= gained and lost + gained <= n):
        raise ValueError(f"paired counts need 0 ≤ lost, gained and lost + gained ≤ n > 0, got {lost}, {gained}, {n}")
    z = float(norm.ppf((1 + level) / 2))
    return _bound(lost, gained, n, z, False), _bound(lost, gained, n, z, True)


@lru_cache(maxsize=64)
def exact_rejections(n: int, margin: float, alpha: float, below: bool) -> np.ndarray:
    """[n+1, n+1] bool over (lost, gained): where the exact unconditional test rejects at level α (Sidik 2003, Stat Med
    22:265, ordered by Tango's score; the supremum over the whole nuisance range). below=True: H0 loss ≥ margin (rejected: PASS);
    below=False: H0 loss ≤ margin (rejected: FAIL). p(x) = sup over P(gained) on the null boundary of P(T ≤ T(x))
    (T ≥ T(x) above), T = Tango's score at the margin."""
    lost, gained = np.nonzero(np.add.outer(np.arange(n + 1), np.arange(n + 1)) <= n)  # every table of n pairs [P]
    score = tango_score(lost, gained, n, margin) * (1 if below else -1)  # [P], small = far from H0
    order = np.argsort(score, kind="stable")
    lost, gained, score = lost[order], gained[order], score[order]  # sorted by score: a tail is a prefix
    tail_end = np.searchsorted(score, score, side="right") - 1  # [P] ties share their tail
    log_tables = gammaln(n + 1) - gammaln(lost + 1) - gammaln(gained + 1) - gammaln(n - lost - gained + 1)  # [P]
    edge = (1 - margin) / 2  # P(gained) on the null boundary runs over (0, (1 − margin) / 2)
    nuisance = (np.arange(1, NUISANCE_GRID) / NUISANCE_GRID * math.sqrt(edge)) ** 2  # [G] √-spaced: fine near 0
    p_value = np.zeros(lost.size)  # [P]
    for chunk in np.array_split(nuisance, max(1, nuisance.size * lost.size // (1 << 22))):
        p_gained = chunk[:, None]  # [g, 1]
        log_p = log_tables + lost * np.log(p_gained + margin) + gained * np.log(p_gained)
        log_p += (n - lost - gained) * np.log1p(-(2 * p_gained + margin))  # [g, P]
        np.maximum(p_value, np.cumsum(np.exp(log_p), axis=1)[:, tail_end].max(0), out=p_value)  # sup over the chunk
    rejects = np.zeros((n + 1, n + 1), dtype=bool)
    rejects[lost, gained] = p_value <= alpha
    return rejects


def design_effect(differences: np.ndarray, clusters: np.ndarray) -> float:
    """Variance of the mean difference with whole clusters as the sampling unit over its variance were the rows
    independent, at least 1 (Rao & Scott 1992, Biometrics 48:577: the ratio estimator's cluster variance).
    differences [N], clusters [N] labels."""
    d = np.asarray(differences, dtype=np.float64)
    _, label = np.unique(np.asarray(clusters), return_inverse=True)
    k, n, mean = int(label.max()) + 1, d.size, float(d.mean())
    if k < 2 or n < 2:
        return 1.0
    residual = np.bincount(label, weights=d - mean, minlength=k)  # [K] S_k − m_k·d̄
    clustered = k / (k - 1) * float((residual**2).sum())
    independent = n / (n - 1) * float(((d - mean) ** 2).sum())
    return 1.0 if independent == 0 else max(1.0, clustered / independent)


def pairs_needed(loss: float, discordance: float, margin: float, alpha: float, power: float) -> int:
    """Pairs at which the score test at the margin shows non-inferiority with probability `power` when the true loss
    is `loss` and a share `discordance` of items differ (Nam 1997, Biometrics 53:1422):
    n = (z_α·σ₀ + z_β·σ₁)² / (margin − loss)², σ₀ under H0 at the restricted estimate, σ₁ under the true loss."""
    if not loss < margin:
        raise ValueError(f"no number of pairs shows a loss of {loss} below a margin of {margin}")
    p_lost, p_gained = (discordance + loss) / 2, (discordance - loss) / 2
    if p_gained < 0 or p_lost + p_gained > 1:
        raise ValueError(f"a loss of {loss} cannot arise when only {discordance} of the items differ")
    null = 2 * float(restricted_gained(p_lost, p_gained, 1.0, margin)) + margin * (1 - margin)
    true = discordance - loss**2
    z_alpha, z_beta = float(norm.ppf(1 - alpha)), float(norm.ppf(power))
    return math.ceil((z_alpha * math.sqrt(null) + z_beta * math.sqrt(true)) ** 2 / (margin - loss) ** 2)


def mover_mean(estimates: list[float], lows: list[float], highs: list[float]) -> tuple[float, float, float]:
    """The mean of independent estimates with an interval recovered from theirs (Zou & Donner 2008, Stat Med 27:1693:
    MOVER for a sum): mean ∓ √Σ(distance to each bound)² / K."""
    d, lo, hi = (np.asarray(x, dtype=np.float64) for x in (estimates, lows, highs))
    mean = float(d.mean())
    below, above = math.sqrt(float(((d - lo) ** 2).sum())), math.sqrt(float(((hi - d) ** 2).sum()))
    return mean, mean - below / d.size, mean + above / d.size


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median with its distribution-free interval [x₍ₗ₎, x₍ₙ₋ₗ₊₁₎], l the largest rank with P(Bin(n, ½) < l) ≤
    (1 − level) / 2 (Conover 1999, Practical Nonparametric Statistics, Sec. 3.2): coverage ≥ level for independent
    values from any continuous distribution. Below 6 values (at 95 %) no rank qualifies: (−inf, inf)."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    if x.ndim != 1 or x.size == 0 or not np.isfinite(x).all():
        raise ValueError(
            f"a median's interval needs finite values, got {x.size} with {int((~np.isfinite(x)).sum())} not"
        )
    tail = (1 - level) / 2
    first = int(binom.ppf(tail, x.size, 0.5))  # the least k with P(Bin ≤ k) ≥ tail
    rank = first + int(binom.cdf(first, x.size, 0.5) <= tail)  # the largest l with P(Bin ≤ l − 1) ≤ tail
    if rank < 1:
        return float(np.median(x)), -math.inf, math.inf
    return float(np.median(x)), float(x[rank - 1]), float(x[x.size - rank])


def median_ratio_interval(
    numerators: list[list[float]], denominator: list[float], level: float = 0.95
) -> tuple[float, float, float]:
    """The least of the numerator samples' medians over the denominator sample's median (a speedup: an engine's best
    re-prefill / a path, each timed in its own loop, so nothing pairs them), with an interval: each of the
    m = len(numerators) + 1 medians gets its order-statistic interval (`median_interval`) at 1 − (1 − level) / m, and
    the ratio's bounds are their extremes, min(low) / high_den and min(high) / low_den. Coverage ≥ level at any n:
    by Bonferroni all m intervals hold at once with probability ≥ level whatever the samples' dependence (one sample
    may sit on both sides), and when they all hold the ratio lies between the bounds. Where a median has too few
    values for its interval (at 95 % and m = 2 each is at 97.5 %: fewer than 7 values, so never at 5) the bounds are
    NaN — undefined, not guessed. Values are positive times."""
    samples = [*numerators, denominator]
    if not numerators or any(min(sample, default=0.0) <= 0 for sample in samples):
        raise ValueError(
            f"a ratio of medians needs one numerator sample or more and positive values, got {len(numerators)} "
            f"numerator sample(s) with sizes {[len(sample) for sample in samples]}"
        )
    each = 1 - (1 - level) / len(samples)
    *tops, (median, low, high) = [median_interval(sample, each) for sample in samples]
    point = min(top[0] for top in tops) / median
    if not all(math.isfinite(bound) for _, *bounds in (*tops, (median, low, high)) for bound in bounds):
        return point, math.nan, math.nan
    return point, min(top[1] for top in tops) / high, min(top[2] for top in tops) / low
