"""Choose the levers of a routed workload on its validation items, never on the items that are reported.

A lever grid runs with `workload.split=valid` (src/tasks.py `subsample`: items no reported test run scores) into
JSON records (tracking.backend=json); this reads them and prints the chosen run's lever overrides, which the
reported run (`workload.split=test`, the default) then uses. The rule is fixed before any run (the gate's
threshold, conf/gate/default.yaml): among the runs whose every task loses ≤ max_loss_points, the one that spends
the least prefill; when none does, the one with the least mean loss (ties: less prefill). A run whose losses are not
all finite (NaN) is never chosen. Reads no MLflow, so it runs on the GPU machine between the two stages. With
`--data`, each run is re-scored on its items outside every reported test subsample (`tasks.reported`; records made
before that split rule shared a few items with test runs). Runs are compared on the same items: where their items
differ, each is re-scored on those all of them scored.

    python -m src.choose RECORDS_DIR [--workload passage] [--direction qwen25coder_0.5b_to_1.5b] [--data shared/data]
        [--expect N] [--experiment routed_frontier3]

`--expect N`: the grid's size — fewer than N distinct lever settings with a finished validation run (a step cut, a
share lost) is refused: a lever chosen from a partial grid would be the one reported on test items. `--experiment`:
only the grid's own runs (another stage's validation runs in the same folder neither fill the grid nor get chosen).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from src.gate import DEFAULTS, task_losses
from src.records import RecordError, items_path, metric_values, read_items, read_record, require
from src.routed import quality
from src.tasks import load_task, reported

LEVERS = "policy.levers."  # old records' levers too: read_record gives today's keys (records.current_params)


def validation_runs(
    directory: Path,
    workload: str | None = None,
    direction: str | None = None,
    data: Path | None = None,
    experiment: str | None = None,
) -> list[dict]:
    """FINISHED routed records on validation items under `directory`: {name, params, tags, metrics}; with `data`
    (the task files) the quality metrics are recomputed on the run's items that no reported test run scores. Runs
    are compared paired: when their items differ (another limit, items dropped as test items), each is re-scored on
    the items all of them scored (`paired`). A truncated record, or one without a key this needs, is a RecordError
    naming the file and the key."""
    runs = []
    for path in sorted(Path(directory).glob("**/record.json")):
        record = read_record(path)
        tags = record["tags"]
        if record.get("status") != "FINISHED" or tags.get("job") != "routed" or tags.get("split") != "valid":
            continue
        if workload not in (None, tags.get("workload")) or direction not in (None, tags.get("direction")):
            continue
        if experiment not in (None, record.get("experiment")):  # another stage's runs in the same folder
            continue
        items = read_items(path.parent) if items_path(path.parent).is_file() else None
        if data is not None:
            if items is None:
                raise RecordError(f"{items_path(path.parent)}: missing (--data re-scores each run from its items)")
            items = held_out(path.parent, record["params"], data, items)
        run = {"name": record["name"], "params": record["params"], "tags": tags, "metrics": metric_values(record, path)}
        runs.append(run | {"items": items, "where": path})
    return [{key: run[key] for key in ("name", "params", "tags", "metrics")} for run in paired(runs, data is not None)]


def held_out(run: Path, params: dict, data: Path, items: list[dict]) -> list[dict]:
    """A run's items less those a reported test run scores."""
    where = run / "record.json"
    limit = require(params, "workload.limit", where)
    limit = None if limit in (None, "None") else int(limit)
    counts = {task: len(load_task(task, data)) for task in {item["task"] for item in items}}
    kept = [item for item in items if item["index"] not in reported(counts[item["task"]], limit, item["task"])]
    if len(kept) < len(items):
        print(f"{run.name}: {len(items) - len(kept)} of {len(items)} items are reported test items: dropped",
              file=sys.stderr)  # fmt: skip
    return kept


def paired(runs: list[dict], rescore: bool) -> list[dict]:
    """The runs with quality metrics on the same items: re-scored on the items every run scored when their item sets
    differ (or when `rescore`: items were dropped); logged metrics where no run kept its items. Runs of which only
    some kept items cannot be paired: a ValueError names them, as does an empty intersection."""
    keyed = {  # by record file: two runs may share a name (a rerun, another item limit)
        run["where"]: None if run["items"] is None else {(i["task"], i["index"]) for i in run["items"]} for run in runs
    }
    if all(keys is None for keys in keyed.values()):
        if len(runs) > 1:
            print(
                "choose: no run kept its items: compared by their logged metrics, pairing unverified", file=sys.stderr
            )
        return runs
    if missing := sorted(where.parent.name for where, keys in keyed.items() if keys is None):
        raise ValueError(f"runs {missing} kept no items (artifacts/routed/items.json) while others did: not paired")
    common = set.intersection(*keyed.values())
    if not common:
        raise ValueError("the validation runs share no item: their losses cannot be compared")
    if not rescore and all(keys == common for keys in keyed.values()):
        return runs
    for run in runs:
        if len(keyed[run["where"]]) > len(common):
            print(f"{run['where'].parent.name}: compared on the {len(common)} items every run scored (of its "
                  f"{len(keyed[run['where']])})", file=sys.stderr)  # fmt: skip
        n_boot, seed = (int(require(run["params"], key, run["where"])) for key in ("eval.tasks.n_boot", "seed"))
        kept = [item for item in run["items"] if (item["task"], item["index"]) in common]
        run["metrics"] = run["metrics"] | quality(kept, n_boot, seed)
    return runs


def _finite_losses(run: dict) -> bool:
    """Every task loss and the mean loss logged and finite: a NaN never looks like the least loss or the least
    prefill (comparisons with NaN are all false, so `min` would keep whichever came first)."""
    losses = [loss for loss, _, _ in task_losses(run["metrics"]).values()]
    mean = run["metrics"].get("task.mean.loss_points", math.nan)
    return bool(losses) and all(math.isfinite(value) for value in [*losses, mean])


def choose(runs: list[dict], max_loss: float | None = None) -> dict:
    """The run the rule picks (module docstring), among the runs whose losses are all finite; a prefill fraction
    that is not finite counts as spending everything."""
    if not runs:
        raise ValueError("no finished routed runs on validation items (workload.split=valid) to choose from")
    max_loss = DEFAULTS.max_loss_points if max_loss is None else max_loss
    scored = [run for run in runs if _finite_losses(run)]
    if not scored:
        names = ", ".join(run["name"] for run in runs)
        raise ValueError(f"no validation run has finite losses on every task and the mean ({names}): none to choose")
    spent = lambda run: run["metrics"].get("prefill_fraction", math.inf)
    spent_or_all = lambda run: spent(run) if math.isfinite(spent(run)) else math.inf
    mean = lambda run: run["metrics"]["task.mean.loss_points"]
    within = [r for r in scored if all(loss <= max_loss for loss, _, _ in task_losses(r["metrics"]).values())]
    if within:
        return min(within, key=lambda r: (spent_or_all(r), mean(r)))
    return min(scored, key=lambda r: (mean(r), spent_or_all(r)))


MAPPER_LEVERS = ("fit.v_space",)  # levers that change the mapper itself: a chosen run's must travel with it


def overrides(run: dict) -> list[str]:
    """The chosen run's lever settings as Hydra overrides: its levers, and the mapper's own (V fitted where it is
    read) where the record names them."""
    chosen = lambda key: key.startswith(LEVERS) or key in MAPPER_LEVERS
    return [f"{key}={value}" for key, value in sorted(run["params"].items()) if chosen(key)]


def require_grid(runs: list[dict], expect: int) -> None:
    """At least `expect` distinct lever settings among `runs`, or a ValueError that counts them."""
    settings = {tuple(overrides(run)) for run in runs}
    if len(settings) < expect:
        raise ValueError(f"{len(settings)} of the grid's {expect} lever settings have a finished validation run: "
                         "no lever is chosen from a partial grid")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--workload")
    parser.add_argument("--direction")
    parser.add_argument("--max-loss", type=float)
    parser.add_argument("--data", type=Path, help="task files: re-score each run without reported test items")
    parser.add_argument("--expect", type=int, default=0, help="the grid's size: refuse to choose from fewer settings")
    parser.add_argument("--experiment", help="only the runs of this tracking experiment (the grid's stage)")
    args = parser.parse_args()
    try:
        runs = validation_runs(args.directory, args.workload, args.direction, args.data, args.experiment)
        require_grid(runs, args.expect)
        chosen = choose(runs, args.max_loss)
    except RecordError as error:
        sys.exit(f"choose: {error}")
    except ValueError as error:
        sys.exit(f"choose: {error} under {args.directory}")
    for run in runs:
        mark = "→" if run is chosen else " "
        m = run["metrics"]
        print(
            f"{mark} {' '.join(overrides(run))}: mean loss {m.get('task.mean.loss_points', math.nan):+.1f} pt, "
            f"prefill {m.get('prefill_fraction', math.nan):.2f}",
            file=sys.stderr,
        )
    print(" ".join(overrides(chosen)))  # stdout: what the reported run passes


if __name__ == "__main__":
    main()
