"""Promotion gate: read the MLflow DB and judge each transfer direction.

A run (one operating point) passes when, all measured in that run:
  latency   handoff_speedup = re-prefill p50 / apply p50 ≥ 2
  quality   every task's loss against the native target ≤ 1 absolute point (`task.<name>.loss_points`),
            measured on real pretrained weights (random-weight runs carry no quality evidence)
  rollback  rollback_verified = 1 (unsafe caches fell back to a bit-identical target prefill)
A criterion with no logged measurement is MISSING and fails: nothing passes by default. A direction
passes when one of its runs passes every criterion; the exit status is non-zero otherwise.

    python -m src.gate --experiment NAME [--parent RUN_ID] [--uri sqlite:///mlruns/mlflow.db]
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import mlflow
from omegaconf import OmegaConf

TASK_PREFIX, TASK_SUFFIX = "task.", ".loss_points"


@dataclass
class Verdict:
    criterion: str
    measured: str
    threshold: str
    status: str  # PASS, FAIL or MISSING


def judge_run(metrics: dict[str, float], tags: dict[str, str], min_speedup: float, max_loss: float) -> list[Verdict]:
    """The three criteria for one run's metrics and tags."""
    verdicts = []
    speedup = metrics.get("handoff_speedup")
    verdicts.append(
        Verdict(
            "latency: re-prefill / handoff",
            "—" if speedup is None else f"{speedup:.2f}×",
            f"≥ {min_speedup}×",
            "MISSING" if speedup is None else ("PASS" if speedup >= min_speedup else "FAIL"),
        )
    )
    losses = {
        k[len(TASK_PREFIX) : -len(TASK_SUFFIX)]: v
        for k, v in metrics.items()
        if k.startswith(TASK_PREFIX) and k.endswith(TASK_SUFFIX)
    }
    if tags.get("weights") != "real" or not losses:
        why = "random weights: no quality evidence" if tags.get("weights") != "real" else "no task measured"
        verdicts.append(Verdict("quality: loss vs native target", why, f"≤ {max_loss} pt every task", "MISSING"))
    elif not all(math.isfinite(v) for v in losses.values()):
        broken = sorted(name for name, v in losses.items() if not math.isfinite(v))
        verdicts.append(Verdict("quality: loss vs native target", f"non-finite: {broken}", f"≤ {max_loss} pt", "FAIL"))
    else:
        worst_task = max(losses, key=losses.get)
        verdicts.append(
            Verdict(
                "quality: loss vs native target",
                f"worst {worst_task} {losses[worst_task]:+.2f} pt",
                f"≤ {max_loss} pt every task",
                "PASS" if losses[worst_task] <= max_loss else "FAIL",
            )
        )
    rollback = metrics.get("rollback_verified")
    verdicts.append(
        Verdict(
            "rollback to prefill",
            "—" if rollback is None else ("verified" if rollback == 1.0 else "broken"),
            "verified",
            "MISSING" if rollback is None else ("PASS" if rollback == 1.0 else "FAIL"),
        )
    )
    return verdicts


def check(uri: str, experiment: str, parent: str | None, min_speedup: float, max_loss: float) -> int:
    """Print each direction's best run against the gate; 0 when every direction passes, else 1."""
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        print(f"gate: FAIL — no MLflow experiment {experiment!r} at {uri}")
        return 1
    query = "tags.job = 'fit_eval'" + (f" and tags.mlflow.parentRunId = '{parent}'" if parent else "")
    runs = mlflow.search_runs(experiment_names=[experiment], filter_string=query, output_format="list")
    runs = [run for run in runs if run.info.status == "FINISHED"]
    if not runs:
        print(f"gate: FAIL — no finished fit_eval runs in {experiment!r}" + (f" under {parent}" if parent else ""))
        return 1
    by_direction: dict[str, list] = {}
    for run in runs:
        by_direction.setdefault(run.data.tags.get("direction", "unknown"), []).append(run)
    failed = False
    for direction, candidates in sorted(by_direction.items()):
        judged = [(judge_run(r.data.metrics, r.data.tags, min_speedup, max_loss), r) for r in candidates]
        verdicts, best = max(
            judged, key=lambda j: (sum(v.status == "PASS" for v in j[0]), j[1].data.metrics.get("handoff_speedup", 0.0))
        )
        passed = all(v.status == "PASS" for v in verdicts)
        failed |= not passed
        print(
            f"\n{direction}: {'PASS' if passed else 'FAIL'} — best of {len(candidates)} run(s): "
            f"{best.info.run_name} ({best.info.run_id[:8]}, weights={best.data.tags.get('weights')})"
        )
        for v in verdicts:
            print(f"  {v.status:<8} {v.criterion:<34} measured {v.measured:<38} threshold {v.threshold}")
    print(f"\ngate: {'FAIL' if failed else 'PASS'}")
    return int(failed)


def main() -> None:
    conf = Path(__file__).resolve().parents[1] / "conf"
    gate, tracking = OmegaConf.load(conf / "gate/default.yaml"), OmegaConf.load(conf / "tracking/mlflow.yaml")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--parent", default=None, help="judge only the children of this (multirun) parent run")
    parser.add_argument("--uri", default=tracking.uri)
    parser.add_argument("--min-speedup", type=float, default=gate.min_speedup)
    parser.add_argument("--max-loss-points", type=float, default=gate.max_loss_points)
    args = parser.parse_args()
    sys.exit(check(args.uri, args.experiment, args.parent, args.min_speedup, args.max_loss_points))


if __name__ == "__main__":
    main()
