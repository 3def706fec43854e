"""Promotion gate: judge ONE routed-workload run (src/routed.py) per workload and direction, everything measured in
that run on that workload, as one-sided tests a statistician would sign (thresholds: conf/gate/default.yaml only):
  routed    the run is a routed workload run (tags job=routed, workload) on the test items (tag split=test). A run on
            the validation items (`workload.split=valid`) made a choice: FAIL, never judged as reported. A run without
            a `split` tag is MISSING: nothing says which items it scored, so it is never read as test items
  latency   ttft_speedup = end-to-end TTFT of the run's own handoffs, re-prefill / routed, median of the paired ratios,
            with its seeded bootstrap 95% CI (`ttft_speedup_low` / `_high`, src/routed.py `speedup_ci`): PASS when the
            CI's lower bound ≥ min_speedup (2×), FAIL when its upper bound is below, UNDERPOWERED between. FAIL too
            when the handoffs spent more than max_prefill_fraction of the receiver's prefill (a run that re-prefills or
            recomputes most of the history is not a transfer, whatever its clock says). MISSING without a logged CI
            ("no CI logged"), with a non-finite or inverted one, or without a finite prefill fraction
  harness   the routed session re-prefilled a sample of handoffs itself (every `workload.same_work_every`-th item,
            src/routed_runs.py `_same_work`; and wherever its policy re-prefilled): the baseline's own work on the same
            clock. The median of re-prefill / that same work (ttft.same_work_ratio) must lie within [1/skew, skew],
            else the clock, not the transfer, made the speedup; MISSING when the run logged none
  quality   per task, a non-inferiority test of native − routed accuracy (points, all-re-prefill session = native)
            against the margin max_loss_points (1 point), on its paired 95% CI: PASS when the CI's upper bound ≤ the
            margin, FAIL when its lower bound > the margin, UNDERPOWERED otherwise — printed with the items that would
            decide it if the observed loss held (`items_to_decide`, at the run's per-item spread
            `task.<task>.loss_points_sd`); a task without a finite, ordered CI is MISSING. Every task must PASS; real
            pretrained weights only (random weights carry no quality evidence)
  prefill   the prefill fraction the handoffs actually spent ≤ max_prefill_fraction; MISSING when not finite
  rollback  rollback_verified = 1: every refusal kind replayed on the workload's items fell back to a bit-identical
            re-prefill
A criterion with no logged measurement, or a non-finite one (NaN, ±inf), is MISSING and fails: nothing passes by
default. A record that predates a metric the gate reads gets it from its per-item scores (`backfill`). The run judged
is the one given (--run), else the latest finished routed run on test items of each (workload, direction, history
length, policy, engine) — never the best of several; runs on validation items, or without a split tag, are never judged
where a test run exists; an item shard of a run (tag `shard`) is never judged alone, only the run its shards join
into (src/routed_merge.py). The history length is the longest TTFT bucket the run logged (`ttft.routed.le_<N>_ms_p50`):
a run on longer histories is another operating point and never shadows the verdict on shorter ones; so is a session
policy other than `map` (tag `policy`, e.g. `auto`), and so is a receiver runtime other than HF eager (tag `engine`:
`static` / `graph`, src/runtime/engine.py). The exit status is non-zero unless every judged run passes. `--summary`
ends with the decision as one table: workload × direction × operating point → latency / harness / quality / rollback.

    python -m src.gate --experiment routed [--run RUN_ID] [--parent RUN_ID] [--uri sqlite:///mlruns/mlflow.db] [--summary]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[1] / "conf"
DEFAULTS = OmegaConf.load(CONF / "gate/default.yaml")  # the one home of every threshold's default
TASK_PREFIX, TASK_SUFFIX = "task.", ".loss_points"
EPSILON = 1e-9  # a loss of exactly the threshold passes: one item in 100 is (0.54 − 0.53) × 100 = 1.0000000000000009


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

    def __post_init__(self) -> None:
        bounds = {
            "min_speedup": (1.0, math.inf, "a speedup below 1× would pass a routed path slower than re-prefill"),
            "max_loss_points": (0.0, 100.0, "a margin in accuracy points"),
            "max_harness_skew": (1.0, math.inf, "a ratio band [1/skew, skew]"),
            "max_prefill_fraction": (0.0, 1.0, "a share of the receiver's prefill"),
        }
        for key, (low, high, meaning) in bounds.items():
            value = getattr(self, key)
            if not isinstance(value, int | float) or not (math.isfinite(value) and low <= value <= high):
                raise ValueError(f"gate {key} must be finite and in [{low:g}, {high:g}] ({meaning}), not {value!r}")


def thresholds(**overrides: float | None) -> Thresholds:
    """The gate's thresholds: conf/gate/default.yaml, each overridden where a value (not None) is given."""
    return Thresholds(
        **{key: DEFAULTS[key] if overrides.get(key) is None else overrides[key] for key in Thresholds.__annotations__}
    )


def _finite(*values: float | None) -> bool:
    """Every value logged and finite. MLflow stores ±inf as ±DBL_MAX, so a magnitude that reaches it is not finite
    either: a run that logged +inf never reads back as a measurement."""
    return all(value is not None and math.isfinite(value) and abs(value) < sys.float_info.max for value in values)


def task_losses(metrics: dict[str, float]) -> dict[str, tuple[float, float | None, float | None]]:
    """task → (loss points, CI low, CI high) for every `task.<name>.loss_points` but the task mean."""
    return {
        key[len(TASK_PREFIX) : -len(TASK_SUFFIX)]: (
            value,
            metrics.get(key + "_low"),
            metrics.get(key + "_high"),
        )
        for key, value in metrics.items()
        if key.startswith(TASK_PREFIX) and key.endswith(TASK_SUFFIX) and key != "task.mean.loss_points"
    }


def items_for(sd_points: float, half_width: float) -> int:
    """Items whose paired 95 % CI half-width is `half_width` points when native − routed has this SD (points)."""
    return math.ceil((1.96 * sd_points / half_width) ** 2)


def items_to_decide(loss: float, sd_points: float, margin: float) -> int | None:
    """Items at which the non-inferiority test would decide, if the observed mean loss held: the paired 95 % CI is
    loss ± 1.96·sd/√n, so its upper bound clears the margin (PASS) once the half-width is below margin − loss, and
    its lower bound exceeds it (FAIL) once the half-width is below loss − margin: n = ⌈(1.96·sd / |margin − loss|)²⌉.
    None when no number of items decides it (the loss sits on the margin) or the spread is unknown (NaN)."""
    if not _finite(loss, sd_points) or abs(margin - loss) <= EPSILON:
        return None
    return items_for(sd_points, abs(margin - loss))


def _task_status(loss: float, low: float | None, high: float | None, margin: float) -> str:
    """One task's non-inferiority verdict: PASS when the CI's upper bound is within the margin, FAIL when its lower
    bound is beyond it, UNDERPOWERED between; MISSING without a finite, ordered CI around a finite loss."""
    if not _finite(loss, low, high) or low > high:
        return "MISSING"
    return "PASS" if high <= margin + EPSILON else "FAIL" if low > margin + EPSILON else "UNDERPOWERED"


def _quality(metrics: dict[str, float], tags: dict[str, str], margin: float) -> Verdict:
    criterion, threshold = "quality: loss vs all-re-prefill", f"95% CI of every task's loss ≤ {margin:g} pt"
    losses = task_losses(metrics)
    if tags.get("weights") != "real":
        return Verdict(criterion, "random weights: no quality evidence", threshold, "MISSING")
    if not losses:
        return Verdict(criterion, "no task measured", threshold, "MISSING")
    lines, found = [], set()
    for task, (loss, low, high) in sorted(losses.items()):
        status = _task_status(loss, low, high, margin)
        found.add(status)
        if low is None or high is None:
            lines.append(f"{task} {loss:+.2f} (no CI)")
            continue
        line = f"{task} {loss:+.2f} [{low:+.2f}, {high:+.2f}]"
        if status == "MISSING":
            line += " (not a finite, ordered CI)"
        elif status == "UNDERPOWERED":
            sd = metrics.get(f"{TASK_PREFIX}{task}{TASK_SUFFIX}_sd", math.nan)
            needs = items_to_decide(loss, sd, margin)
            if needs is not None:
                line += f" (≈ {needs} items would show {'PASS' if loss < margin else 'FAIL'} at this loss)"
            elif _finite(sd):
                line += " (on the margin: no item count decides it at this loss)"
        lines.append(line)
    mean = [metrics.get(f"task.mean.loss_points{end}") for end in ("", "_low", "_high")]
    if _finite(*mean):
        lines.append("mean {:+.2f} [{:+.2f}, {:+.2f}]".format(*mean))
    status = next(s for s in ("FAIL", "MISSING", "UNDERPOWERED", "PASS") if s in found)
    return Verdict(criterion, "; ".join(lines), threshold, status)


def _latency(metrics: dict[str, float], min_speedup: float, max_prefill: float) -> Verdict:
    """PASS when the bootstrap CI's lower bound of the median paired speedup is ≥ min_speedup and the handoffs spent
    at most max_prefill of the receiver's prefill; FAIL when the CI lies below min_speedup or the prefill spent is
    over the bound; UNDERPOWERED between; MISSING without a finite, ordered CI or a finite prefill fraction."""
    criterion, threshold = (
        "latency: end-to-end TTFT speedup",
        f"95% CI low ≥ {min_speedup:g}×, prefill ≤ {max_prefill:g}",
    )
    speedup, low, high = (metrics.get(key) for key in ("ttft_speedup", "ttft_speedup_low", "ttft_speedup_high"))
    fraction = metrics.get("prefill_fraction")
    if speedup is None:
        return Verdict(criterion, "—", threshold, "MISSING")
    if low is None or high is None:
        return Verdict(criterion, f"{speedup:.2f}× (no CI logged)", threshold, "MISSING")
    measured = f"{speedup:.2f}× [{low:.2f}, {high:.2f}] (p50 {metrics.get('ttft.routed_ms_p50', math.nan):.1f} ms)"
    if not _finite(speedup, low, high) or not 0 < low <= high:
        return Verdict(criterion, measured + ": not a finite, ordered CI", threshold, "MISSING")
    if not _finite(fraction):
        return Verdict(criterion, measured + f", prefill fraction {fraction}: not measured", threshold, "MISSING")
    if fraction > max_prefill:
        return Verdict(
            criterion, measured + f", but {fraction:.2f} of the prefill spent: not a transfer", threshold, "FAIL"
        )
    status = "PASS" if low >= min_speedup else "FAIL" if high < min_speedup else "UNDERPOWERED"
    return Verdict(criterion, measured, threshold, status)


def _harness(metrics: dict[str, float], skew: float) -> Verdict:
    criterion, threshold = "latency harness: same work alike", f"re-prefill / routed within [{1 / skew:.2f}, {skew}]×"
    ratio = metrics.get("ttft.same_work_ratio")
    if ratio is None:
        return Verdict(criterion, "no same-work re-prefill timed in the routed session", threshold, "MISSING")
    items = metrics.get("ttft.same_work_items", math.nan)
    status = "MISSING" if not _finite(ratio) else "PASS" if 1 / skew <= ratio <= skew else "FAIL"
    return Verdict(criterion, f"{ratio:.2f}× on {items:.0f} re-prefilled handoffs", threshold, status)


def _prefill(metrics: dict[str, float], max_prefill: float) -> Verdict:
    fraction = metrics.get("prefill_fraction")
    status = "MISSING" if not _finite(fraction) else "PASS" if fraction <= max_prefill else "FAIL"
    measured = "—" if fraction is None else f"{fraction:.3f}"
    return Verdict("prefill fraction spent", measured, f"≤ {max_prefill:g}", status)


def _routed(tags: dict[str, str]) -> Verdict:
    """A routed workload run on the test items; one without a `split` tag is refused, never read as test items."""
    routed = tags.get("job") == "routed" and bool(tags.get("workload"))
    split = tags.get("split")
    measured = f"job={tags.get('job')}, workload={tags.get('workload')}, split={split or '— (no split tag)'}"
    status = "MISSING" if not routed or split is None else "PASS" if split == "test" else "FAIL"
    return Verdict("routed workload run", measured, "job=routed, split=test", status)  # valid items choose, never gate


def judge_run(metrics: dict[str, float], tags: dict[str, str], limits: Thresholds | None = None) -> list[Verdict]:
    """The criteria for one run's metrics and tags (thresholds default to conf/gate/default.yaml)."""
    limits = thresholds() if limits is None else limits
    rollback = metrics.get("rollback_verified")
    return [
        _routed(tags),
        _latency(metrics, limits.min_speedup, limits.max_prefill_fraction),
        _harness(metrics, limits.max_harness_skew),
        _quality(metrics, tags, limits.max_loss_points),
        _prefill(metrics, limits.max_prefill_fraction),
        Verdict(
            "rollback on this workload",
            "—" if rollback is None else ("verified" if rollback == 1.0 else "broken"),
            "verified",
            "MISSING" if rollback is None else ("PASS" if rollback == 1.0 else "FAIL"),
        ),
    ]


def is_shard(tags: dict[str, str]) -> bool:
    """The run scored one item shard of a run (tag `shard`, src/routed.py): judged only joined with the others
    (src/routed_merge.py), never alone — a shard's CI is not the run's."""
    return "shard" in tags


def history_regime(metrics: dict[str, float]) -> str:
    """`≤ N tokens` for the longest history-length bucket with routed TTFTs in the run (src/routed.py timing), or
    `any length` when it logged none."""
    found = (key.split(".") for key in metrics if key.startswith("ttft.routed.") and key.endswith("_ms_p50"))
    edges = [parts[2].removesuffix("_ms_p50") for parts in found if len(parts) == 3]
    if not edges:
        return "any length"
    longest = max(edges, key=lambda edge: (edge.startswith("gt_"), int(edge[3:])))
    return f"{'>' if longest.startswith('gt_') else '≤'} {int(longest[3:])} tokens"


def operating_point(metrics: dict[str, float], tags: dict[str, str], on_test: bool = True) -> str:
    """What a run's verdict is about beside its workload and direction: the history length (`history_regime`; any
    length for runs off the test items), a session policy other than `map`, a receiver runtime other than HF eager."""
    regime = history_regime(metrics) if on_test else "any length"
    policy = tags.get("policy", "map")  # a session that chooses per handoff: its own point
    regime += "" if policy == "map" else f", policy {policy}"
    engine = tags.get("engine", "hf")  # the receiver runtime: another operating point
    return regime + ("" if engine == "hf" else f", engine {engine}")


def backfill(metrics: dict[str, float], items: list[dict], params: dict[str, str]) -> dict[str, float]:
    """A record that predates `ttft.same_work_ratio`, `task.<task>.loss_points_sd` or the speedup's CI
    (`ttft_speedup_low` / `_high`) gets them from its per-item scores (routed/items.json; src/routed.py `same_work`,
    `loss_spread`, `speedup_ci`, the CI resampled as the run's own: `eval.tasks.n_boot`, `seed`); logged metrics win."""
    from src.routed import loss_spread, same_work, speedup_ci

    n_boot, seed = params.get("eval.tasks.n_boot"), params.get("seed")
    latency = speedup_ci(items, int(n_boot), int(seed)) if n_boot is not None and seed is not None else {}
    return loss_spread(items) | same_work(items) | latency | metrics


def _backfilled(run) -> dict[str, float]:
    """The run's metrics, backfilled from its items artifact when it has one (a damaged one is a RecordError)."""
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException

    from src.tracking import items_of, read_json

    metrics = dict(run.data.metrics)
    where = f"{run.info.artifact_uri}/routed/items.json"
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small file, no bar in the verdict
    with tempfile.TemporaryDirectory() as folder:
        try:
            local = download_artifacts(artifact_uri=where, dst_path=folder)
        except (MlflowException, OSError):  # no items artifact: nothing to backfill from
            return metrics
        items = items_of(read_json(Path(local), where), where)
    return backfill(metrics, items, run.data.params)


def check(
    uri: str,
    experiment: str,
    parent: str | None = None,
    min_speedup: float | None = None,
    max_loss: float | None = None,
    run: str | None = None,
    max_skew: float | None = None,
    max_prefill_fraction: float | None = None,
    summary: bool = False,
) -> int:
    """Print the verdict of each judged run; 0 when every one passes, else 1. Thresholds default to
    conf/gate/default.yaml; one that cannot hold is a ValueError naming it, before any run is read. summary: end with
    the decision as one table (`summary_table`)."""
    import mlflow

    limits = thresholds(
        min_speedup=min_speedup,
        max_loss_points=max_loss,
        max_harness_skew=max_skew,
        max_prefill_fraction=max_prefill_fraction,
    )
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        print(f"gate: FAIL — no MLflow experiment {experiment!r} at {uri}")
        return 1
    query = "tags.job = 'routed'" + (f" and tags.mlflow.parentRunId = '{parent}'" if parent else "")
    runs = mlflow.search_runs(
        experiment_names=[experiment],
        filter_string=query,
        output_format="list",
        order_by=["attributes.start_time DESC"],
    )
    runs = [r for r in runs if r.info.status == "FINISHED" and (run is None or r.info.run_id == run)]
    parts = [r for r in runs if is_shard(r.data.tags)]
    if parts:
        print(f"gate: {len(parts)} item shard(s) of runs not judged alone (joined: python -m src.routed_merge)")
        runs = [r for r in runs if not is_shard(r.data.tags)]
    if not runs:
        where = f" under {parent}" if parent else ""
        print(f"gate: FAIL — no finished routed run{f' {run}' if run else 's'} in {experiment!r}{where}")
        return 1
    split = lambda run: run.data.tags.get("split")  # no tag: refused (judge_run), never read as test items
    on_test = lambda run: split(run) == "test"
    workload = lambda run: (run.data.tags.get("workload", "unknown"), run.data.tags.get("direction", "unknown"))
    tested = {workload(run) for run in runs if on_test(run)}
    groups: dict[tuple[str, str, str], list] = {}
    for candidate in runs:  # newest first; a (workload, direction) with test runs is judged on them only
        if on_test(candidate) or workload(candidate) not in tested:
            regime = operating_point(candidate.data.metrics, candidate.data.tags, on_test(candidate))
            groups.setdefault((*workload(candidate), regime), []).append(candidate)
    validation = Counter(workload(run) for run in runs if split(run) == "valid")
    untagged = Counter(workload(run) for run in runs if split(run) is None)
    failed, rows = False, []
    for (name, direction, regime), candidates in sorted(groups.items()):
        judged = candidates[0]  # the latest; a later run on validation items never shadows the reported one
        verdicts = judge_run(_backfilled(judged), judged.data.tags, limits)
        rows.append((name, direction, regime, verdicts))
        passed = all(v.passed for v in verdicts)
        failed |= not passed
        refused = untagged[(name, direction)]
        print(
            f"\n{name} · {direction} · histories {regime}: {'PASS' if passed else 'FAIL'} — run "
            f"{judged.info.run_name} ({judged.info.run_id[:8]}, weights={judged.data.tags.get('weights')}; latest of "
            f"{sum(on_test(c) for c in candidates)} on test items, not the best; "
            f"{validation[(name, direction)]} on validation items not judged"
            + (f"; {refused} without a split tag refused)" if refused else ")")
        )
        for v in verdicts:
            print(f"  {v.status:<12} {v.criterion:<34} measured {v.measured}  (threshold {v.threshold})")
    if summary:
        print("\n" + summary_table(rows))
    print(f"\ngate: {'FAIL' if failed else 'PASS'}")
    return int(failed)


SUMMARY_CRITERIA = ("routed workload run", "latency", "latency harness", "quality", "rollback")  # by criterion name


def summary_table(rows: list[tuple[str, str, str, list[Verdict]]]) -> str:
    """The decision in one Markdown table: per workload × direction × operating point (history length, policy,
    engine), each criterion's status with what was measured, and the run's verdict."""
    head = "| workload | direction | operating point | " + " | ".join(SUMMARY_CRITERIA) + " | verdict |"
    lines = [head, "|" + "---|" * (4 + len(SUMMARY_CRITERIA))]
    for name, direction, regime, verdicts in rows:
        by_name = {v.criterion.split(":")[0].removesuffix(" on this workload"): v for v in verdicts}
        cells = [f"{by_name[c].status}: {by_name[c].measured}" if c in by_name else "—" for c in SUMMARY_CRITERIA]
        verdict = "PASS" if all(v.passed for v in verdicts) else "FAIL"
        lines.append(
            f"| {name} | {direction} | {regime} | " + " | ".join(c.replace("|", "/") for c in cells) + f" | {verdict} |"
        )
    return "\n".join(lines)


def main() -> None:
    tracking = OmegaConf.load(CONF / "tracking/mlflow.yaml")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default=DEFAULTS.experiment)
    parser.add_argument("--run", default=DEFAULTS.run, help="judge this run only")
    parser.add_argument("--parent", default=DEFAULTS.parent, help="judge only the children of this (multirun) run")
    parser.add_argument("--uri", default=tracking.uri)
    parser.add_argument("--min-speedup", type=float, help="default: conf/gate/default.yaml")
    parser.add_argument("--max-loss-points", type=float, help="the non-inferiority margin; default: the YAML's")
    parser.add_argument("--max-harness-skew", type=float, help="default: conf/gate/default.yaml")
    parser.add_argument("--max-prefill-fraction", type=float, help="default: conf/gate/default.yaml")
    parser.add_argument("--summary", action="store_true", help="end with the decision as one table")
    args = parser.parse_args()
    try:
        status = check(
            args.uri,
            args.experiment,
            args.parent,
            args.min_speedup,
            args.max_loss_points,
            args.run,
            args.max_harness_skew,
            args.max_prefill_fraction,
            args.summary,
        )
    except ValueError as error:  # a threshold that cannot hold, a damaged items artifact
        parser.error(str(error))
    sys.exit(status)


if __name__ == "__main__":
    main()
