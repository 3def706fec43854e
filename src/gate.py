"""Promotion gate: judge ONE routed-workload run per operating point — the run a plan registered before it ran — from
its own items, as one-sided tests a statistician would sign (thresholds: conf/gate/default.yaml only):
  routed    a routed workload run (tags job=routed, workload) on the test items (tag split=test): a run on the
            validation items made a choice (FAIL); one without a `split` tag is MISSING, never read as test items
  record    every logged metric the gate could rely on equals what the run's items give (recomputed by src/routed.py
            as src/routed_merge.py does, src/gate_evidence.py): a disagreement FAILs naming both, and so does a logged
            point outside its own logged CI; a run without its items artifact is MISSING — the gate judges items only
  latency   the median over handoffs of re-prefill / routed TTFT, with its 95 % interval (order statistics for
            independent handoffs, exact; a bootstrap of whole conversations where turns cluster) over at least
            min_timed_units units: PASS when the low bound ≥ min_speedup, FAIL when the high bound is below, else
            UNDERPOWERED; FAIL when the handoffs spent more than max_prefill_fraction of the receiver's prefill
  harness   baseline re-prefill / the same re-prefill timed in the routed session on the sampled handoffs: its
            median's 95 % interval inside [1/skew, skew] PASSes, wholly outside FAILs, else (or on fewer than
            min_timed_units) UNDERPOWERED; none sampled: MISSING
  quality   per task, native − routed accuracy on the same items against the margin max_loss_points
            (src/eval/intervals.py): the exact unconditional test for independent items, Tango's score on counts
            deflated by the design effect for turns of a conversation — PASS when it rejects a loss ≥ the margin at
            2.5 %, FAIL when it rejects a loss ≤ the margin, else UNDERPOWERED, and UNDERPOWERED below min_task_units
            units whatever it says; printed with Tango's 95 % interval and, when undecided, the units still needed for
            `power` at the planned loss (planned_loss_points: a stated effect). Every task must PASS; real weights only
  prefill   the share of the receiver's prefill the handoffs spent (their records) ≤ max_prefill_fraction
  rollback  every refusal kind replayed on the workload (`rollback.<kind>`) fell back bit-identically, and the run's
            `rollback_verified` agrees with them
Nothing passes by default: a criterion with no measurement, or a non-finite one, is MISSING. Runs are grouped per
workload × direction × operating point (src/gate_plan.py: history length, dtype, shots, levers, policy, engine); a
point is judged on the run its plan entry named before it ran (results/gate_plans.yaml), later runs of it counted and
never judged, its verdict the worst of its criteria (FAIL, MISSING, UNDERPOWERED, PASS); a point without an entry
is shown on its latest run as UNREGISTERED. Test-item runs only where a
(workload, direction) has them; a shard (tag `shard`, or params workload.shards > 1) is never judged alone. The exit
status is 0 only when every judged point PASSes; `--summary` ends with the decision as one table.

    python -m src.gate --experiment routed [--run RUN_ID] [--parent RUN_ID] [--plans FILE] [--summary]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from src.gate_criteria import DEFAULTS, Thresholds, Verdict, judge_run, run_status, thresholds
from src.gate_evidence import Evidence, evidence, is_shard
from src.gate_plan import Pick, Plans, load_plans, operating_point, pick, registered

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TASK_PREFIX, TASK_SUFFIX = "task.", ".loss_points"


def task_losses(metrics: dict[str, float]) -> dict[str, tuple[float, float | None, float | None]]:
    """task → (loss points, CI low, CI high) for every logged `task.<name>.loss_points` but the task mean."""
    return {
        key[len(TASK_PREFIX) : -len(TASK_SUFFIX)]: (value, metrics.get(key + "_low"), metrics.get(key + "_high"))
        for key, value in metrics.items()
        if key.startswith(TASK_PREFIX) and key.endswith(TASK_SUFFIX) and key != "task.mean.loss_points"
    }


# --- the decision over many runs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """One workload × direction × operating point: the run judged (`chosen`), its criteria, and the verdict — PASS,
    FAIL, MISSING, UNDERPOWERED (the worst criterion), or UNREGISTERED (no plan entry named a run of it) — with the
    (workload, direction)'s runs on validation items and without a split tag, never judged."""

    workload: str
    direction: str
    point: str
    chosen: Pick
    verdicts: list[Verdict]
    outcome: str
    validation: int
    untagged: int

    @property
    def passed(self) -> bool:
        return self.outcome == "PASS"


def outcome(chosen: Pick, verdicts: list[Verdict], plans: Plans) -> str:
    """The worst criterion (`run_status`: FAIL, MISSING, UNDERPOWERED or PASS) for a registered run; UNREGISTERED
    (why; what its criteria say) for any other."""
    status = run_status([v.status for v in verdicts])
    if chosen.plan is not None:
        return status
    why = "predates plans" if chosen.predates(plans) else "no plan entry"
    return f"UNREGISTERED ({why}; criteria {status})"


def decide(
    runs: list[Evidence],
    plans: Plans,
    limits: Thresholds,
    load: Callable[[Evidence], Evidence] = lambda run: run,
    only: str | None = None,
) -> list[Decision]:
    """Every operating point of these finished routed runs (shards left out), judged on its registered run (`load`
    gives it its items); `only`: the point of that run id, judged on that run."""
    runs = [run for run in runs if not is_shard(run.tags, run.params)]
    split = lambda run: run.tags.get("split")  # no tag: refused (judge_run), never read as test items
    pair = lambda run: (run.tags.get("workload", "unknown"), run.tags.get("direction", "unknown"))
    tested = {pair(run) for run in runs if split(run) == "test"}
    groups: dict[tuple[str, str, str], list[Evidence]] = {}
    for run in runs:  # a (workload, direction) with test runs is judged on them only
        if split(run) == "test" or pair(run) not in tested:
            groups.setdefault((*pair(run), operating_point(run, split(run) == "test")), []).append(run)
    validation = Counter(pair(run) for run in runs if split(run) == "valid")
    untagged = Counter(pair(run) for run in runs if split(run) is None)
    entries = registered(runs, plans)
    decisions = []
    for (workload, direction, point), members in sorted(groups.items()):
        chosen = pick(members, entries)
        if only is not None:
            if only not in {run.run_id for run in members}:
                continue
            if chosen.judged.run_id != only:  # named after the fact: shown, never the point's verdict
                chosen = Pick(next(run for run in members if run.run_id == only), chosen.runs, None, 0)
        verdicts = judge_run(load(chosen.judged), limits)
        decisions.append(
            Decision(
                workload,
                direction,
                point,
                chosen,
                verdicts,
                outcome(chosen, verdicts, plans),
                validation[(workload, direction)],
                untagged[(workload, direction)],
            )
        )
    return decisions


def runs_cell(chosen: Pick) -> str:
    """How many runs of the point and which one is judged."""
    if chosen.plan is None:
        return f"latest of {chosen.runs}" if chosen.runs > 1 else "1"
    later = f", {chosen.later} later not judged" if chosen.later else ""
    return f"plan {chosen.plan.id}'s run, of {chosen.runs}{later}"


SUMMARY_CRITERIA = ("routed workload run", "record", "latency", "latency harness", "quality", "rollback")


def summary_table(decisions: list[Decision]) -> str:
    """The decision in one Markdown table: per workload × direction × operating point, the runs of it, each
    criterion's status with what was measured, and the verdict."""
    head = "| workload | direction | operating point | runs | " + " | ".join(SUMMARY_CRITERIA) + " | verdict |"
    lines = [head, "|" + "---|" * (5 + len(SUMMARY_CRITERIA))]
    for d in decisions:
        by_name = {v.criterion.split(":")[0].removesuffix(" on this workload"): v for v in d.verdicts}
        cells = [f"{by_name[c].status}: {by_name[c].measured}" if c in by_name else "—" for c in SUMMARY_CRITERIA]
        lines.append(
            f"| {d.workload} | {d.direction} | {d.point} | {runs_cell(d.chosen)} | "
            + " | ".join(c.replace("|", "/") for c in cells)
            + f" | {d.outcome} |"
        )
    return "\n".join(lines)


# --- over an MLflow store -------------------------------------------------------------------------------------------


def _from_mlflow(run, with_items: bool) -> Evidence:
    """A finished MLflow run as Evidence (params under today's names), with its items artifact when asked and present
    (a damaged one is a RecordError)."""
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException

    from src.records import current_params, read_json

    where = f"{run.info.artifact_uri}/routed/items.json"
    document = None
    if with_items:
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small file, no bar in the verdict
        with tempfile.TemporaryDirectory() as folder:
            try:
                document = read_json(Path(download_artifacts(artifact_uri=where, dst_path=folder)), where)
            except (MlflowException, OSError):  # no items artifact: judged as a run without items
                document = None
    data = run.data
    params = current_params(dict(data.params))
    return evidence(
        run.info.run_name, run.info.run_id, run.info.start_time, data.metrics, params, data.tags, document, where
    )


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
    plans: Path | None = None,
) -> int:
    """Print the verdict of each operating point; 0 when every one PASSes, else 1. Thresholds default to
    conf/gate/default.yaml and the plans to results/gate_plans.yaml; either, when it cannot hold, is a ValueError
    naming it before any run is read. summary: end with the decision as one table (`summary_table`)."""
    import mlflow

    limits = thresholds(
        min_speedup=min_speedup,
        max_loss_points=max_loss,
        max_harness_skew=max_skew,
        max_prefill_fraction=max_prefill_fraction,
    )
    registry = load_plans(ROOT / DEFAULTS.plans if plans is None else plans)
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        print(f"gate: FAIL — no MLflow experiment {experiment!r} at {uri}")
        return 1
    query = "tags.job = 'routed'" + (f" and tags.mlflow.parentRunId = '{parent}'" if parent else "")
    found = mlflow.search_runs(experiment_names=[experiment], filter_string=query, output_format="list")
    finished = {r.info.run_id: r for r in found if r.info.status == "FINISHED"}
    runs = [_from_mlflow(r, False) for r in finished.values()]
    parts = [r for r in runs if is_shard(r.tags, r.params)]
    if parts:
        print(f"gate: {len(parts)} item shard(s) of runs not judged alone (joined: python -m src.routed_merge)")
    load = lambda chosen: _from_mlflow(finished[chosen.run_id], True)
    decisions = decide(runs, registry, limits, load, run)
    if not decisions:
        where = f" under {parent}" if parent else ""
        print(f"gate: FAIL — no finished routed run{f' {run}' if run else 's'} to judge in {experiment!r}{where}")
        return 1
    for d in decisions:
        judged = d.chosen.judged
        refused = f"; {d.untagged} without a split tag refused" if d.untagged else ""
        print(
            f"\n{d.workload} · {d.direction} · {d.point}: {d.outcome} — run {judged.name} ({judged.run_id[:8]}, "
            f"weights={judged.tags.get('weights')}; {runs_cell(d.chosen)} on test items, never the best; "
            f"{d.validation} on validation items not judged{refused})"
        )
        for v in d.verdicts:
            print(f"  {v.status:<12} {v.criterion:<34} measured {v.measured}  (threshold {v.threshold})")
    if summary:
        print("\n" + summary_table(decisions))
    failed = not all(d.passed for d in decisions)
    print(f"\ngate: {'FAIL' if failed else 'PASS'}")
    return int(failed)


def main() -> None:
    tracking = OmegaConf.load(CONF / "tracking/mlflow.yaml")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default=DEFAULTS.experiment)
    parser.add_argument("--run", default=DEFAULTS.run, help="judge this run only (counts only if registered)")
    parser.add_argument("--parent", default=DEFAULTS.parent, help="judge only the children of this (multirun) run")
    parser.add_argument("--uri", default=tracking.uri)
    parser.add_argument("--plans", type=Path, help="pre-registered runs; default: results/gate_plans.yaml")
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
            args.plans,
        )
    except ValueError as error:  # a threshold that cannot hold, a bad plans file, a damaged items artifact
        parser.error(str(error))
    sys.exit(status)


if __name__ == "__main__":
    main()
