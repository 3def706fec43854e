"""The gate's small-sample statistics (src/eval/intervals.py): Tango's interval against PropCIs::scoreci.mp, the exact
unconditional test whose false-PASS rate at the margin is at most 2.5 % at every n and discordance (computed exactly
here, and where Tango's asymptotic test exceeds it), the design effect of clustered turns, Nam's sample size, the
order-statistic interval of a median and of a ratio of two medians timed apart, MOVER over tasks. The simulated
coverage over n = 20 … 800 and true losses 0 … 3 points is scripts/gate_coverage.py (BENCHMARKS § reliability)."""

import math

import numpy as np
import pytest
from scipy.special import gammaln
from scipy.stats import binom, norm

from src.eval.intervals import (
    design_effect,
    exact_rejections,
    median_interval,
    median_ratio_interval,
    mover_mean,
    pairs_needed,
    tango_interval,
    tango_score,
)
from src.gate_criteria import Paired, decide_task, thresholds


@pytest.mark.parametrize(
    ("lost", "gained", "n", "level", "expected"),
    [(28, 25, 618, 0.90, (-0.0148, 0.0247)), (20, 60, 1000, 0.95, (-0.0584, -0.0231))],
)
def test_tango_interval_matches_propcis(lost, gained, n, level, expected):
    """PropCIs::scoreci.mp(gained, lost, n, level) — its (b, c) are our (gained, lost) — to four decimals; the
    bounds solve the score equation at ∓z, and swapping lost and gained mirrors the interval."""
    low, high = tango_interval(lost, gained, n, level)
    assert (round(low, 4), round(high, 4)) == expected
    z = norm.ppf((1 + level) / 2)
    assert tango_score(lost, gained, n, low) == pytest.approx(z, abs=1e-6)
    assert tango_score(lost, gained, n, high) == pytest.approx(-z, abs=1e-6)
    assert tango_interval(gained, lost, n, level) == pytest.approx((-high, -low))


def test_no_item_differing_is_no_zero_width_interval():
    """The bootstrap's [0, 0]: Tango's interval is ±z²/(n + z²) — under a point only from ≈ 380 items."""
    z2 = norm.ppf(0.975) ** 2
    for n in (20, 100, 380, 400):
        assert tango_interval(0, 0, n)[1] == pytest.approx(z2 / (n + z2), rel=1e-6)
    assert tango_interval(0, 0, 380)[1] > 0.01 > tango_interval(0, 0, 400)[1]


def _size(rejects: np.ndarray, n: int, discordance: float, loss: float = 0.01) -> float:
    """P(the test rejects) when the true loss is `loss` and a share `discordance` of items differ: the trinomial
    summed over every table."""
    lost, gained = np.nonzero(np.add.outer(np.arange(n + 1), np.arange(n + 1)) <= n)
    p_lost, p_gained = (discordance + loss) / 2, (discordance - loss) / 2
    log_p = gammaln(n + 1) - gammaln(lost + 1) - gammaln(gained + 1) - gammaln(n - lost - gained + 1)
    log_p += lost * math.log(p_lost) + gained * math.log(p_gained) + (n - lost - gained) * math.log1p(-discordance)
    return float(np.exp(log_p)[rejects[lost, gained]].sum())


@pytest.mark.parametrize("n", [50, 100, 200, 300])
def test_the_exact_test_passes_a_one_point_loss_at_most_2_5_percent_of_the_time(n):
    """At a true loss of exactly the margin, for the discordance of the committed records (a few % to 15 %) and
    beyond: PASS at most 2.5 %, exactly; FAIL at most 2.5 % too."""
    for discordance in (0.02, 0.03, 0.05, 0.08, 0.10, 0.15, 0.30):
        assert _size(exact_rejections(n, 0.01, 0.025, True), n, discordance) <= 0.025, discordance
        assert _size(exact_rejections(n, 0.01, 0.025, False), n, discordance) <= 0.025, discordance


def test_tangos_asymptotic_test_alone_would_pass_a_one_point_loss_too_often():
    """Why the exact test: at n = 200 and 5 % discordance Tango's score test (the upper bound of its 95 % interval
    ≤ the margin) PASSes a true 1-point loss 2.6 % of the time."""
    n, z = 200, norm.ppf(0.975)
    lost, gained = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    asymptotic = tango_score(lost, gained, n, 0.01) <= -z
    assert _size(asymptotic, n, 0.05) > 0.0255 > _size(exact_rejections(n, 0.01, 0.025, True), n, 0.05)


def test_the_exact_regions_are_monotone_and_are_what_the_gate_decides():
    """A table with one more lost item never passes where the original did not; the gate's task verdict is the
    region's (at min_task_units units and beyond)."""
    n = 120
    passes, fails = exact_rejections(n, 0.01, 0.025, True), exact_rejections(n, 0.01, 0.025, False)
    assert not (passes & fails).any()
    for lost in range(1, n):
        for gained in range(n - lost):
            assert passes[lost - 1, gained] or not passes[lost, gained]
            assert fails[lost, gained] or not fails[lost - 1, gained]
    limits = thresholds(max_loss_points=1.0)
    for lost, gained in ((0, 0), (0, 5), (3, 0), (12, 0), (20, 1), (1, 5), (10, 2)):  # the last two: where the
        status = decide_task(Paired(lost, gained, n, n), limits).status  # asymptotic test decides otherwise
        assert status == ("PASS" if passes[lost, gained] else "FAIL" if fails[lost, gained] else "UNDERPOWERED")


def test_the_design_effect_of_clusters():
    rng = np.random.default_rng(0)
    singletons = rng.integers(-1, 2, 200)
    assert design_effect(singletons, np.arange(200)) == 1.0  # every row its own cluster
    whole = np.repeat(rng.integers(-1, 2, 25), 8)  # 25 conversations whose 8 turns all agree
    assert design_effect(whole, np.repeat(np.arange(25), 8)) == pytest.approx(8, rel=0.15)
    assert design_effect(np.zeros(40), np.repeat(np.arange(5), 8)) == 1.0  # nothing differs: nothing to inflate
    assert design_effect(np.array([1, -1] * 20), np.repeat(np.arange(20), 2)) == 1.0  # never below 1


def test_nams_sample_size():
    """With no item differing the score test needs z²(1 − m)/m pairs (the rule of three's neighbour); more
    discordance, more pairs; a planned loss at the margin is no plan."""
    assert pairs_needed(0.0, 0.0, 0.01, 0.025, 0.8) == math.ceil(norm.ppf(0.975) ** 2 * 0.99 / 0.01)
    assert pairs_needed(0.0, 0.05, 0.01, 0.025, 0.8) < pairs_needed(0.0, 0.10, 0.01, 0.025, 0.8)
    assert pairs_needed(0.0, 0.05, 0.01, 0.025, 0.9) > pairs_needed(0.0, 0.05, 0.01, 0.025, 0.8)
    with pytest.raises(ValueError, match="no number of pairs"):
        pairs_needed(0.01, 0.05, 0.01, 0.025, 0.8)
    n = pairs_needed(0.0, 0.0, 0.01, 0.025, 0.8)  # the score test's n; the exact test's is within a few items
    assert decide_task(Paired(0, 0, n + 10, n + 10), thresholds()).status == "PASS"
    assert decide_task(Paired(0, 0, n - 20, n - 20), thresholds()).status == "UNDERPOWERED"


@pytest.mark.parametrize("n", [6, 7, 10, 20, 31, 100, 201])
def test_the_median_interval_covers_at_least_95_percent(n):
    """[x₍ₗ₎, x₍ₙ₋ₗ₊₁₎] holds the true median with probability 1 − 2·P(Bin(n, ½) ≤ l − 1) ≥ 0.95, and l is the
    largest rank that does."""
    median, low, high = median_interval(list(range(1, n + 1)))
    rank = int(low)
    assert high == n + 1 - rank and median == (n + 1) / 2
    assert 1 - 2 * binom.cdf(rank - 1, n, 0.5) >= 0.95 > 1 - 2 * binom.cdf(rank, n, 0.5)
    assert median_interval([1.0] * 5)[1:] == (-math.inf, math.inf)  # 5 values cannot give 95 %


def test_mover_over_tasks():
    assert mover_mean([0.01], [-0.02], [0.05]) == pytest.approx((0.01, -0.02, 0.05))  # one task: its own interval
    mean, low, high = mover_mean([0.0, 0.02], [-0.03, -0.02], [0.04, 0.05])
    assert mean == pytest.approx(0.01)
    assert low == pytest.approx(0.01 - math.hypot(0.03, 0.04) / 2) and high == pytest.approx(
        0.01 + math.hypot(0.04, 0.03) / 2
    )


def test_a_ratio_of_medians_takes_each_median_at_its_bonferroni_level():
    """Two samples at 95 %: each median's order-statistic interval at 97.5 % (rank 5 of 20, not 95 %'s rank 6), the
    ratio's bounds from their extremes; three (a best of two re-prefills): each at 98.3 % (rank 1 of 10, not 2)."""
    ranks = list(map(float, range(1, 21)))  # x₍ᵢ₎ = i
    assert median_ratio_interval([ranks], ranks) == (1.0, 5 / 16, 16 / 5)
    ten = ranks[:10]
    assert median_ratio_interval([ten], ten)[1:] == (2 / 9, 9 / 2)  # rank 2 at 97.5 %
    point, low, high = median_ratio_interval([[2 * x for x in ten], ten], ten)
    assert (point, low, high) == (1.0, 1 / 10, 10 / 1)  # rank 1: the least numerator's extremes
    assert low <= point <= high


@pytest.mark.parametrize(("n", "defined"), [(5, False), (6, False), (7, True)])
def test_a_ratio_of_medians_has_no_interval_below_7_values(n, defined):
    """At 97.5 % a median needs 7 values (P(all on one side) = 2⁻⁶ > 1.25 % at 6): below, the bounds are NaN (the
    default 5 re-prefill repeats give none), never a narrower level's; a sample of 20 beside it does not help."""
    few, many = [float(x) for x in range(1, n + 1)], [float(x) for x in range(1, 21)]
    for numerators, denominator in (([few], many), ([many], few)):
        point, low, high = median_ratio_interval(numerators, denominator)
        assert math.isfinite(point) and math.isfinite(low) == defined and math.isfinite(high) == defined
    if defined:
        assert median_ratio_interval([few], many)[1:] == (1 / 16, n / 5)  # x₍₁₎, x₍ₙ₎ of the 7


def test_a_ratio_of_medians_refuses_what_is_not_a_time():
    for numerators, denominator in (([], [1.0]), ([[1.0, 0.0]], [1.0]), ([[1.0]], [])):
        with pytest.raises(ValueError, match="positive values"):
            median_ratio_interval(numerators, denominator)


@pytest.mark.parametrize(
    ("sizes", "shared"), [((20, 20), False), ((7, 20), False), ((7, 7, 20), False), ((7, 7), True)]
)
def test_a_ratio_of_medians_covers_at_least_95_percent(sizes, shared):
    """2,000 draws of lognormal timings (skewed, unequal spreads; the true medians e^μ): the interval holds the true
    least median / median at ≥ 95 % − 1 point — with a best of two numerators, and with the denominator one of them
    (an engine's re-prefill against its best re-prefill). Bonferroni with extreme bounds is conservative: ≈ 99 %."""
    rng = np.random.default_rng(7)
    mus, sigmas = np.array([3.0, 3.1, 1.0])[: len(sizes)], np.array([0.3, 0.1, 0.6])[: len(sizes)]
    truth = np.exp(mus[:-1]).min() / np.exp(mus[-1]) if not shared else np.exp(mus).min() / np.exp(mus[0])
    covered = 0
    for _ in range(2000):
        samples = [list(rng.lognormal(mu, sigma, n)) for mu, sigma, n in zip(mus, sigmas, sizes, strict=True)]
        numerators, denominator = (samples, samples[0]) if shared else (samples[:-1], samples[-1])
        _, low, high = median_ratio_interval(numerators, denominator)
        covered += low <= truth <= high
    assert covered / 2000 >= 0.94
