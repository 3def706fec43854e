"""Promotion gate: judge ONE routed-workload run (src/routed.py) per workload and direction, everything measured in
that run on that workload:
  routed    the run is a routed workload run (tags job=routed, workload) on the test items (a run on the validation
            items, `workload.split=valid`, made a choice: it is never judged)
  latency   ttft_speedup = end-to-end TTFT of the run's own handoffs, re-prefill / routed (median of paired ratios) ≥ 2
  quality   every task's loss against the all-re-prefill session (the native target) ≤ 1 absolute point, printed with
            its paired 95% CI; UNDERPOWERED (not a pass) when a CI's half-width exceeds 2 points — more items are
            needed before PASS can be claimed, and where the loss still passes it says how many (the items that bring the
            half-width to the bound at the run's own per-item spread, `task.<task>.loss_points_sd`); real pretrained
            weights only (random weights carry no quality evidence)
  harness   where the routed session re-prefilled (policy auto, a refusal), it did the baseline's own work: the
            median of re-prefill / routed TTFT over those handoffs must lie within [1/skew, skew]
            (ttft.same_work_ratio), else the clock, not the transfer, made the speedup; printed as not checkable
            when every handoff mapped
  prefill   the prefill fraction the handoffs actually spent, printed (a run that re-prefills everything cannot
            show the speedup)
  rollback  rollback_verified = 1: every refusal kind replayed on the workload's items fell back to a bit-identical
            re-prefill
A criterion with no logged measurement is MISSING and fails: nothing passes by default. The run judged is the one
given (--run), else the latest finished routed run on test items of each (workload, direction, history length,
policy) — never the best of several; runs on validation items are never judged. The history length is the longest
TTFT bucket the run logged (`ttft.routed.le_<N>_ms_p50`): a run on longer histories is another operating point and
never shadows the verdict on shorter ones; so is a session policy other than `map` (tag `policy`, e.g. `auto`). The
exit status is non-zero unless every judged run passes.

    python -m src.gate --experiment routed [--run RUN_ID] [--parent RUN_ID] [--uri sqlite:///mlruns/mlflow.db]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
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


def _quality(metrics: dict[str, float], tags: dict[str, str], max_loss: float, max_half_width: float) -> Verdict:
    criterion, threshold = "quality: loss vs all-re-prefill", f"≤ {max_loss} pt every task, CI ± ≤ {max_half_width}"
    losses = task_losses(metrics)
    if tags.get("weights") != "real":
        return Verdict(criterion, "random weights: no quality evidence", threshold, "MISSING")
    if not losses:
        return Verdict(criterion, "no task measured", threshold, "MISSING")
    lines, failed, missing, wide = [], False, False, False
    for task, (loss, low, high) in sorted(losses.items()):
        if low is None or high is None:
            missing = True
            lines.append(f"{task} {loss:+.2f} (no CI)")
            continue
        finite = all(math.isfinite(x) for x in (loss, low, high))
        failed |= not finite or loss > max_loss + EPSILON
        too_wide = finite and (high - low) / 2 > max_half_width
        wide |= too_wide
        sd = metrics.get(f"{TASK_PREFIX}{task}{TASK_SUFFIX}_sd")
        undecided = too_wide and math.isfinite(sd or math.nan) and loss <= max_loss + EPSILON  # more items may PASS
        needs = f" (≈ {items_for(sd, max_half_width)} items for ±{max_half_width:g})" if undecided else ""
        lines.append(f"{task} {loss:+.2f} [{low:+.2f}, {high:+.2f}]{needs}")
    mean = [metrics.get(f"task.mean.loss_points{end}") for end in ("", "_low", "_high")]
    if None not in mean:
        lines.append("mean {:+.2f} [{:+.2f}, {:+.2f}]".format(*mean))
    status = "FAIL" if failed else "MISSING" if missing else "UNDERPOWERED" if wide else "PASS"
    return Verdict(criterion, "; ".join(lines), threshold, status)


def _harness(metrics: dict[str, float], skew: float) -> Verdict:
    if not skew >= 1:  # [1/skew, skew] would be empty (or nan): every run would fail for a typo
        raise ValueError(f"gate max_harness_skew must be ≥ 1 (a ratio band [1/skew, skew]), not {skew}")
    criterion, threshold = "latency harness: same work alike", f"re-prefill / routed within [{1 / skew:.2f}, {skew}]×"
    ratio = metrics.get("ttft.same_work_ratio")
    if ratio is None:
        return Verdict(criterion, "not checkable: no re-prefilled handoff in this run", threshold, "REPORTED")
    items = metrics.get("ttft.same_work_items", math.nan)
    status = "PASS" if 1 / skew <= ratio <= skew else "FAIL"  # nan fails
    return Verdict(criterion, f"{ratio:.2f}× on {items:.0f} re-prefilled handoffs", threshold, status)


def judge_run(
    metrics: dict[str, float],
    tags: dict[str, str],
    min_speedup: float | None = None,
    max_loss: float | None = None,
    max_half_width: float | None = None,
    max_skew: float | None = None,
) -> list[Verdict]:
    """The criteria for one run's metrics and tags (thresholds default to conf/gate/default.yaml)."""
    min_speedup = DEFAULTS.min_speedup if min_speedup is None else min_speedup
    max_loss = DEFAULTS.max_loss_points if max_loss is None else max_loss
    max_half_width = DEFAULTS.max_ci_half_width if max_half_width is None else max_half_width
    routed = tags.get("job") == "routed" and bool(tags.get("workload"))
    split = tags.get("split", "test")  # runs before the item splits scored test items
    verdicts = [
        Verdict(
            "routed workload run",
            f"job={tags.get('job')}, workload={tags.get('workload')}, split={split}",
            "job=routed, split=test",
            "PASS" if routed and split == "test" else "FAIL" if routed else "MISSING",  # valid items choose, never gate
        )
    ]
    speedup = metrics.get("ttft_speedup")
    status = "MISSING" if speedup is None else "PASS" if speedup >= min_speedup else "FAIL"  # nan fails
    measured = "—" if speedup is None else f"{speedup:.2f}× (p50 {metrics.get('ttft.routed_ms_p50', math.nan):.1f} ms)"
    verdicts.append(Verdict("latency: end-to-end TTFT speedup", measured, f"≥ {min_speedup}×", status))
    verdicts.append(_harness(metrics, DEFAULTS.max_harness_skew if max_skew is None else max_skew))
    verdicts.append(_quality(metrics, tags, max_loss, max_half_width))
    fraction = metrics.get("prefill_fraction")
    verdicts.append(
        Verdict(
            "prefill fraction spent",
            "—" if fraction is None else f"{fraction:.3f}",
            "printed",
            "MISSING" if fraction is None else "REPORTED",
        )
    )
    rollback = metrics.get("rollback_verified")
    verdicts.append(
        Verdict(
            "rollback on this workload",
            "—" if rollback is None else ("verified" if rollback == 1.0 else "broken"),
            "verified",
            "MISSING" if rollback is None else ("PASS" if rollback == 1.0 else "FAIL"),
        )
    )
    return verdicts


def history_regime(metrics: dict[str, float]) -> str:
    """`≤ N tokens` for the longest history-length bucket with routed TTFTs in the run (src/routed.py timing), or
    `any length` when it logged none."""
    found = (key.split(".") for key in metrics if key.startswith("ttft.routed.") and key.endswith("_ms_p50"))
    edges = [parts[2].removesuffix("_ms_p50") for parts in found if len(parts) == 3]
    if not edges:
        return "any length"
    longest = max(edges, key=lambda edge: (edge.startswith("gt_"), int(edge[3:])))
    return f"{'>' if longest.startswith('gt_') else '≤'} {int(longest[3:])} tokens"


def backfill(metrics: dict[str, float], items: list[dict]) -> dict[str, float]:
    """A record that predates `ttft.same_work_ratio` and `task.<task>.loss_points_sd` gets them from its per-item
    scores (routed/items.json; src/routed.py `same_work`, `loss_spread`); logged metrics win."""
    from src.routed import loss_spread, same_work

    return loss_spread(items) | same_work(items) | metrics


def _backfilled(run) -> dict[str, float]:
    """The run's metrics, backfilled from its items artifact when it has one."""
    from mlflow.artifacts import load_dict
    from mlflow.exceptions import MlflowException

    metrics = dict(run.data.metrics)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small file, no bar in the verdict
    try:
        items = load_dict(f"{run.info.artifact_uri}/routed/items.json")["items"]
    except (MlflowException, OSError, KeyError):
        return metrics
    return backfill(metrics, items)


def check(
    uri: str,
    experiment: str,
    parent: str | None = None,
    min_speedup: float | None = None,
    max_loss: float | None = None,
    max_half_width: float | None = None,
    run: str | None = None,
    max_skew: float | None = None,
) -> int:
    """Print the verdict of each judged run; 0 when every one passes, else 1."""
    import mlflow

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
    if not runs:
        where = f" under {parent}" if parent else ""
        print(f"gate: FAIL — no finished routed run{f' {run}' if run else 's'} in {experiment!r}{where}")
        return 1
    on_test = lambda run: run.data.tags.get("split", "test") == "test"
    workload = lambda run: (run.data.tags.get("workload", "unknown"), run.data.tags.get("direction", "unknown"))
    tested = {workload(run) for run in runs if on_test(run)}
    groups: dict[tuple[str, str, str], list] = {}
    for candidate in runs:  # newest first; a (workload, direction) with test runs is judged on them only
        if on_test(candidate) or workload(candidate) not in tested:
            regime = history_regime(candidate.data.metrics) if on_test(candidate) else "any length"
            policy = candidate.data.tags.get("policy", "map")  # a session that chooses per handoff: its own point
            regime += "" if policy == "map" else f", policy {policy}"
            groups.setdefault((*workload(candidate), regime), []).append(candidate)
    validation = Counter(workload(run) for run in runs if not on_test(run))
    failed = False
    for (name, direction, regime), candidates in sorted(groups.items()):
        judged = candidates[0]  # the latest; a later run on validation items never shadows the reported one
        verdicts = judge_run(_backfilled(judged), judged.data.tags, min_speedup, max_loss, max_half_width, max_skew)
        passed = all(v.passed for v in verdicts)
        failed |= not passed
        print(
            f"\n{name} · {direction} · histories {regime}: {'PASS' if passed else 'FAIL'} — run "
            f"{judged.info.run_name} ({judged.info.run_id[:8]}, weights={judged.data.tags.get('weights')}; latest of "
            f"{sum(on_test(c) for c in candidates)} on test items, not the best; "
            f"{validation[(name, direction)]} on validation items not judged)"
        )
        for v in verdicts:
            print(f"  {v.status:<12} {v.criterion:<34} measured {v.measured}  (threshold {v.threshold})")
    print(f"\ngate: {'FAIL' if failed else 'PASS'}")
    return int(failed)


def main() -> None:
    tracking = OmegaConf.load(CONF / "tracking/mlflow.yaml")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default=DEFAULTS.experiment)
    parser.add_argument("--run", default=DEFAULTS.run, help="judge this run only")
    parser.add_argument("--parent", default=DEFAULTS.parent, help="judge only the children of this (multirun) run")
    parser.add_argument("--uri", default=tracking.uri)
    parser.add_argument("--min-speedup", type=float, default=DEFAULTS.min_speedup)
    parser.add_argument("--max-loss-points", type=float, default=DEFAULTS.max_loss_points)
    parser.add_argument("--max-ci-half-width", type=float, default=DEFAULTS.max_ci_half_width)
    parser.add_argument("--max-harness-skew", type=float, default=DEFAULTS.max_harness_skew)
    args = parser.parse_args()
    try:
        status = check(
            args.uri,
            args.experiment,
            args.parent,
            args.min_speedup,
            args.max_loss_points,
            args.max_ci_half_width,
            args.run,
            args.max_harness_skew,
        )
    except ValueError as error:  # a threshold that cannot hold
        parser.error(str(error))
    sys.exit(status)


if __name__ == "__main__":
    main()
