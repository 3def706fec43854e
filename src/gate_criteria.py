"""The gate's criteria on ONE routed run, judged from its items (src/gate.py groups runs and decides; the criteria
and their thresholds are listed there, the defaults in conf/gate/default.yaml)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf
from scipy.stats import norm

from src.eval.intervals import (
    design_effect,
    exact_rejections,
    median_interval,
    mover_mean,
    pairs_needed,
    tango_interval,
    tango_score,
)
from src.gate_evidence import Evidence, correct, disagreements, recomputed, sampling_units
from src.routed import median_ci, same_work_ratios, speedup_ratios

DEFAULTS = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf/gate/default.yaml")  # every threshold's default
ALPHA = 0.025  # each side of the gate's 95 % intervals: a one-sided test at 2.5 %


@dataclass
class Verdict:
    criterion: str
    measured: str
    threshold: str
    status: str  # PASS, FAIL, MISSING, UNDERPOWERED, or REPORTED (printed, not a criterion of its own)

    @property
    def passed(self) -> bool:
        return self.status in ("PASS", "REPORTED")


@dataclass(frozen=True)
class Thresholds:
    """The gate's thresholds (defaults: conf/gate/default.yaml); one that cannot hold is a ValueError naming it."""

    min_speedup: float
    max_loss_points: float
    max_harness_skew: float
    max_prefill_fraction: float
    min_task_units: int
    min_timed_units: int
    planned_loss_points: float
    power: float

    def __post_init__(self) -> None:
        bounds = {
            "min_speedup": (1.0, math.inf, "a speedup below 1× would pass a routed path slower than re-prefill"),
            "max_loss_points": (0.0, 100.0, "a margin in accuracy points"),
            "max_harness_skew": (1.0, math.inf, "a ratio band [1/skew, skew]"),
            "max_prefill_fraction": (0.0, 1.0, "a share of the receiver's prefill"),
            "min_task_units": (1, math.inf, "a count of items or conversations"),
            "min_timed_units": (1, math.inf, "a count of handoffs or conversations"),
            "planned_loss_points": (0.0, self.max_loss_points, "a true loss below the margin, in points"),
            "power": (0.5, 1.0, "a probability of PASS"),
        }
        for key, (low, high, meaning) in bounds.items():
            value = getattr(self, key)
            if not isinstance(value, int | float) or not (math.isfinite(value) and low <= value <= high):
                raise ValueError(f"gate {key} must be finite and in [{low:g}, {high:g}] ({meaning}), not {value!r}")
        if not (self.planned_loss_points < self.max_loss_points and self.power < 1):
            raise ValueError("gate planned_loss_points must lie below the margin and power below 1: else no plan")


def thresholds(**overrides: float | None) -> Thresholds:
    """The gate's thresholds: conf/gate/default.yaml, each overridden where a value (not None) is given."""
    return Thresholds(
        **{key: DEFAULTS[key] if overrides.get(key) is None else overrides[key] for key in Thresholds.__annotations__}
    )


def _finite(*values: float | None) -> bool:
    """Every value logged and finite. MLflow stores ±inf as ±DBL_MAX, so a magnitude that reaches it is not finite
    either: a run that logged +inf never reads back as a measurement."""
    return all(value is not None and math.isfinite(value) and abs(value) < sys.float_info.max for value in values)


# --- quality: one task's paired outcomes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Paired:
    """One task's paired outcomes: items the routed session lost (native right, routed wrong) and gained, of `rows`
    scored rows in `units` sampling units, and the design effect of that clustering (1: independent items)."""

    lost: int
    gained: int
    rows: int
    units: int
    design_effect: float = 1.0

    @property
    def clustered(self) -> bool:
        return self.units < self.rows


def paired(native: np.ndarray, routed: np.ndarray, units: list[str]) -> Paired:
    """The counts of native [N] vs routed [N] correctness, rows grouped by their sampling unit [N]."""
    differences = native.astype(np.float64) - routed.astype(np.float64)  # [N] 1 lost, −1 gained, 0 alike
    count = len(set(units))
    effect = design_effect(differences, np.asarray(units)) if count < len(units) else 1.0
    return Paired(int((differences > 0).sum()), int((differences < 0).sum()), len(units), count, effect)


@dataclass(frozen=True)
class TaskVerdict:
    status: str
    loss: float  # points, native − routed
    low: float  # Tango's 95 % interval, points
    high: float


def task_status(counts: Paired, limits: Thresholds) -> str:
    """One task's non-inferiority verdict: PASS when the test rejects a loss ≥ the margin at 2.5 %, FAIL when it
    rejects a loss ≤ the margin, else UNDERPOWERED — UNDERPOWERED too below min_task_units units. Independent items:
    the exact unconditional test; turns of a conversation: Tango's score on the counts over the design effect."""
    if counts.units < limits.min_task_units:
        return "UNDERPOWERED"
    margin = limits.max_loss_points / 100
    if counts.clustered:
        lost, gained, n = (x / counts.design_effect for x in (counts.lost, counts.gained, counts.rows))
        score, z = float(tango_score(lost, gained, n, margin)), float(norm.ppf(1 - ALPHA))
        below, above = score <= -z, score >= z
    else:
        below = bool(exact_rejections(counts.rows, margin, ALPHA, True)[counts.lost, counts.gained])
        above = bool(exact_rejections(counts.rows, margin, ALPHA, False)[counts.lost, counts.gained])
    return "PASS" if below else "FAIL" if above else "UNDERPOWERED"


def decide_task(counts: Paired, limits: Thresholds) -> TaskVerdict:
    """`task_status` with the loss and Tango's 95 % interval (on the deflated counts where turns cluster), points."""
    lost, gained, n = (x / counts.design_effect for x in (counts.lost, counts.gained, counts.rows))
    low, high = tango_interval(lost, gained, n, 1 - 2 * ALPHA)
    return TaskVerdict(task_status(counts, limits), 100 * (lost - gained) / n, 100 * low, 100 * high)


def run_status(statuses: list[str]) -> str:
    """The worst of several statuses — a run's quality from its tasks', a point's verdict from its criteria: FAIL if
    one fails, else MISSING if evidence is absent (or none is given), else UNDERPOWERED if one is undecided, else
    PASS (REPORTED is printed, never judged). Only PASS passes; UNDERPOWERED says "not shown", never "shown worse"."""
    if not statuses:
        return "MISSING"
    return next((s for s in ("FAIL", "MISSING", "UNDERPOWERED") if s in statuses), "PASS")


def still_needed(counts: Paired, limits: Thresholds) -> int:
    """Units to add before the test shows PASS with probability `power` if the true loss is the planned one (Nam's
    pairs at the run's share of differing items, times the design effect, in units; at least min_task_units in all).
    ≤ 0: as many units as the plan asks are in, and the loss itself leaves the task undecided."""
    planned, margin = limits.planned_loss_points / 100, limits.max_loss_points / 100
    discordance = max((counts.lost + counts.gained) / counts.rows, planned)  # a loss needs items that differ
    rows = pairs_needed(planned, discordance, margin, ALPHA, limits.power) * counts.design_effect
    return max(math.ceil(rows * counts.units / counts.rows), limits.min_task_units) - counts.units


def _units_of(run: Evidence, rows: list[dict]) -> list[str]:
    """The sampling unit of each of `rows` (rows of the run's items): a ValueError where the run's rows cannot be
    judged (src/gate_evidence.py `sampling_units`)."""
    units = dict(zip(map(id, run.items), sampling_units(run.items, run.tags.get("workload")), strict=True))
    return [units[id(row)] for row in rows]


def _described(counts: Paired) -> str:
    if counts.clustered:
        return (
            f"{counts.rows} turns in {counts.units} conversations ({counts.lost + counts.gained} differ, design effect "
            f"{counts.design_effect:.2f})"
        )
    return f"{counts.rows} items ({counts.lost + counts.gained} differ)"


def task_verdicts(run: Evidence, limits: Thresholds) -> list[tuple[str, Paired, TaskVerdict]]:
    """Each task of the run's items: (task, its paired counts, its verdict); a ValueError names why the rows cannot
    be judged (none, turns without their conversation, an item scored twice)."""
    if run.items is None:
        raise ValueError("no per-item rows: quality is judged from items only")
    if not run.items:
        raise ValueError("the items artifact holds no scored item")
    units = _units_of(run, run.items)
    found = []
    for task in sorted({row["task"] for row in run.items}):
        chosen = [n for n, row in enumerate(run.items) if row["task"] == task]
        counts = paired(*correct([run.items[n] for n in chosen], task), [units[n] for n in chosen])
        found.append((task, counts, decide_task(counts, limits)))
    return found


def mean_loss(found: list[tuple[str, Paired, TaskVerdict]]) -> tuple[float, float, float]:
    """The mean loss over tasks, points, with its interval recovered from the tasks' (MOVER): shown, never judged."""
    return mover_mean(*([getattr(v, name) for _, _, v in found] for name in ("loss", "low", "high")))


def _quality(run: Evidence, limits: Thresholds) -> Verdict:
    criterion = "quality: loss vs all-re-prefill"
    threshold = (
        f"every task's loss < {limits.max_loss_points:g} pt at 2.5 % (exact test), ≥ {limits.min_task_units} units"
    )
    if run.tags.get("weights") != "real":
        return Verdict(criterion, "random weights: no quality evidence", threshold, "MISSING")
    try:
        found = task_verdicts(run, limits)
    except ValueError as error:
        return Verdict(criterion, str(error), threshold, "MISSING")
    lines = []
    for task, counts, verdict in found:
        line = f"{task} {verdict.loss:+.2f} [{verdict.low:+.2f}, {verdict.high:+.2f}] on {_described(counts)}"
        if verdict.status == "UNDERPOWERED":
            more, noun = still_needed(counts, limits), "conversations" if counts.clustered else "items"
            short = f"below the {limits.min_task_units}-unit minimum; " if counts.units < limits.min_task_units else ""
            plan = f"≈ {more} more {noun} for {limits.power:.0%} power at a true loss of {limits.planned_loss_points:g}"
            line += f" ({short}{plan})" if more > 0 else f" ({short}undecided at the planned items: the loss decides)"
        lines.append(line)
    if len(found) > 1:  # shown, not judged: every task is
        lines.append("mean {:+.2f} [{:+.2f}, {:+.2f}]".format(*mean_loss(found)))
    return Verdict(criterion, "; ".join(lines), threshold, run_status([v.status for _, _, v in found]))


# --- medians: the speedup and the harness ---------------------------------------------------------------------------


def _median(values: list[float], units: list[str]) -> tuple[float, float, float, int]:
    """(median, low, high, units): the order-statistic 95 % interval over independent values, a bootstrap of whole
    units (conf/gate n_boot, seed) where several values share one."""
    count = len(set(units))
    if count < len(values):
        found = median_ci(values, DEFAULTS.n_boot, DEFAULTS.seed, 1 - 2 * ALPHA, units)
        return found.estimate, found.low, found.high, count
    return (*median_interval(values, 1 - 2 * ALPHA), count)


@dataclass(frozen=True)
class Median:
    """A median the gate judges, with its 95 % interval over `units` sampling units (`noun`)."""

    value: float
    low: float
    high: float
    units: int
    noun: str


def median_of(run: Evidence, ratios: Callable[[list[dict]], list[tuple[dict, float]]], absent: str) -> Median:
    """The median of the (item, ratio) pairs `ratios` finds in the run's items, with its interval (`_median`); a
    ValueError says why there is none to judge (no items, `absent`, a ratio that is not finite, rows refused)."""
    if run.items is None:
        raise ValueError("no per-item rows: judged from items only")
    pairs = ratios(run.items)
    if not pairs:
        raise ValueError(absent)
    values = [ratio for _, ratio in pairs]
    if not all(math.isfinite(value) for value in values):
        raise ValueError("a TTFT of 0 or NaN: not every ratio is finite")
    median, low, high, count = _median(values, _units_of(run, [item for item, _ in pairs]))
    return Median(median, low, high, count, "conversations" if count < len(values) else "handoffs")


def _latency(run: Evidence, found: dict[str, float], limits: Thresholds) -> Verdict:
    criterion = "latency: end-to-end TTFT speedup"
    threshold = f"95% CI low ≥ {limits.min_speedup:g}×, prefill ≤ {limits.max_prefill_fraction:g}"
    try:
        m = median_of(run, speedup_ratios, "no handoff timed on both paths")
    except ValueError as error:
        return Verdict(criterion, str(error), threshold, "MISSING")
    p50 = found.get("ttft.routed_ms_p50", math.nan)
    measured = f"{m.value:.2f}× [{m.low:.2f}, {m.high:.2f}] on {m.units} {m.noun} (p50 {p50:.1f} ms)"
    fraction = found.get("prefill_fraction")
    if not _finite(fraction):
        return Verdict(criterion, measured + ", prefill fraction: not measured", threshold, "MISSING")
    if fraction > limits.max_prefill_fraction:
        return Verdict(
            criterion, measured + f", but {fraction:.2f} of the prefill spent: not a transfer", threshold, "FAIL"
        )
    if m.units < limits.min_timed_units:
        return Verdict(criterion, measured + f": fewer than {limits.min_timed_units}", threshold, "UNDERPOWERED")
    status = "PASS" if m.low >= limits.min_speedup else "FAIL" if m.high < limits.min_speedup else "UNDERPOWERED"
    return Verdict(criterion, measured, threshold, status)


def _harness(run: Evidence, limits: Thresholds) -> Verdict:
    skew = limits.max_harness_skew
    criterion = "latency harness: same work alike"
    threshold = f"95% CI of re-prefill / routed within [{1 / skew:.2f}, {skew}]×"
    try:
        m = median_of(run, same_work_ratios, "no same-work re-prefill timed in the routed session")
    except ValueError as error:
        return Verdict(criterion, str(error), threshold, "MISSING")
    measured = f"{m.value:.2f}× [{m.low:.2f}, {m.high:.2f}] on {m.units} re-prefilled {m.noun}"
    if m.units < limits.min_timed_units:
        return Verdict(criterion, measured + f": fewer than {limits.min_timed_units}", threshold, "UNDERPOWERED")
    inside, outside = 1 / skew <= m.low and m.high <= skew, m.high < 1 / skew or m.low > skew
    return Verdict(criterion, measured, threshold, "PASS" if inside else "FAIL" if outside else "UNDERPOWERED")


# --- what the records carry -----------------------------------------------------------------------------------------


def _prefill(run: Evidence, found: dict[str, float], limits: Thresholds) -> Verdict:
    fraction = found.get("prefill_fraction") if run.items is not None else None
    status = "MISSING" if not _finite(fraction) else "PASS" if fraction <= limits.max_prefill_fraction else "FAIL"
    measured = f"{fraction:.3f} (from the handoff records)" if fraction is not None else "— (no handoff records)"
    return Verdict("prefill fraction spent", measured, f"≤ {limits.max_prefill_fraction:g}", status)


def _rollback(metrics: dict[str, float]) -> Verdict:
    """PASS when every refusal kind replayed (`rollback.<kind>`) held and `rollback_verified`, if logged, says so."""
    criterion, threshold = "rollback on this workload", "every refusal kind bit-identical"
    kinds = {key: value for key, value in metrics.items() if key.startswith("rollback.") and key.count(".") == 1}
    flag = metrics.get("rollback_verified")
    if not kinds or not _finite(*kinds.values(), *([] if flag is None else [flag])):
        return Verdict(criterion, f"no finite refusal kind replayed (rollback_verified = {flag})", threshold, "MISSING")
    broken = sorted(key for key, value in kinds.items() if value != 1.0)
    named = ", ".join(f"{key} = {kinds[key]:g}" for key in broken)
    if flag is not None and (flag == 1.0) != (not broken):
        contradiction = named or f"all {len(kinds)} refusal kinds held"
        return Verdict(criterion, f"rollback_verified = {flag:g} contradicts {contradiction}", threshold, "FAIL")
    if broken:
        return Verdict(criterion, f"broken: {named}", threshold, "FAIL")
    return Verdict(criterion, f"verified on {len(kinds)} refusal kinds", threshold, "PASS")


def _record(run: Evidence, found: dict[str, float], own_cis: bool) -> Verdict:
    criterion, threshold = "record: logged = items", "every logged metric recomputed from the items"
    named = disagreements(run, found, own_cis)
    if named:
        return Verdict(criterion, "; ".join(named), threshold, "FAIL")
    if run.items is None:
        return Verdict(
            criterion, "no items artifact: nothing to check the logged metrics against", threshold, "MISSING"
        )
    checked = sum(1 for key in run.metrics if key in found)
    return Verdict(
        criterion, f"{checked} logged metrics equal their recomputation from {len(run.items)} rows", threshold, "PASS"
    )


def _routed(tags: dict[str, str]) -> Verdict:
    """A routed workload run on the test items; one without a `split` tag is refused, never read as test items."""
    routed = tags.get("job") == "routed" and bool(tags.get("workload"))
    split = tags.get("split")
    measured = f"job={tags.get('job')}, workload={tags.get('workload')}, split={split or '— (no split tag)'}"
    status = "MISSING" if not routed or split is None else "PASS" if split == "test" else "FAIL"
    return Verdict("routed workload run", measured, "job=routed, split=test", status)  # valid items choose, never gate


def judge_run(run: Evidence, limits: Thresholds | None = None) -> list[Verdict]:
    """The criteria for one run, judged from its items (thresholds default to conf/gate/default.yaml)."""
    limits = thresholds() if limits is None else limits
    found, own_cis = recomputed(run)
    return [
        _routed(run.tags),
        _record(run, found, own_cis),
        _latency(run, found, limits),
        _harness(run, limits),
        _quality(run, limits),
        _prefill(run, found, limits),
        _rollback(run.metrics),
    ]
