"""What the gate reads of one routed run, and the run judged from its items (src/gate.py).

A run is its record — metrics, params, tags, start time — and, where it has one, its items artifact
(routed/items.json: a row per scored turn, the handoff records). Wherever the items exist the gate recomputes what it
judges from them, with the routed job's own functions (src/routed.py `quality`, `timing`, `handoffs`, as
src/routed_merge.py joins shards), and a logged metric that disagrees with them is named beside what the items give.

The sampling unit: a row is an item, except where rows are turns of one conversation (multiturn: the row's
`conversation`), which are resampled whole; rows of a multiturn run that do not say their conversation, or rows that
score one item twice, are refused rather than treated as independent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from src.records import RecordError, items_of
from src.routed import handoffs, quality, timing
from src.routed_runs import task_scores
from src.tasks import METRICS

CLUSTERED = {"multiturn": "conversation"}  # workloads whose rows are turns: the row key naming their conversation
TRIPLES = ("ttft_speedup", "task.mean.loss_points")  # logged with `_low` / `_high`: the point must lie inside
CLAIMED = ("task.", "ttft_speedup", "ttft.same_work_", "prefill_fraction")  # logged keys that speak for the items
MODES = ("routed", "native_target", "native_source")
ROW = ("task", "index", "label", "lengths", "history_tokens", "turn_tokens", "scores", "nll", "ttft", "handoff")
MOVE = ("sender", "receiver", "status", "path", "context", "hit", "prefill_fraction", "bytes")  # a handoff record


@dataclass(frozen=True)
class Evidence:
    """One finished routed run as the gate reads it. `items` / `handoffs`: the rows of its items artifact, None
    where the run has none."""

    name: str
    run_id: str
    start_time: int  # ms since the epoch
    metrics: dict[str, float]
    params: dict[str, str]
    tags: dict[str, str]
    items: list[dict] | None = None
    handoffs: list[dict] | None = None
    where: str = "routed/items.json"  # named in errors


def evidence(name, run_id, start_time, metrics, params, tags, document: dict | None, where: str) -> Evidence:
    """An Evidence from a record and its items document ({"items": [...], "handoffs": [...]}, or None), each row
    checked for what the gate reads: a RecordError naming the artifact and the row otherwise."""
    if document is None:
        return Evidence(name, run_id, int(start_time or 0), dict(metrics), dict(params), dict(tags), where=where)
    items, moves = items_of(document, where), document.get("handoffs", [])
    if not isinstance(moves, list):
        raise RecordError(f"{where}: 'handoffs' is a {type(moves).__name__}, not a list of records")
    for n, row in enumerate(items):
        scores = row.get("scores") if isinstance(row, dict) else None
        if not (isinstance(scores, dict) and set(ROW) <= row.keys() and set(MODES) <= scores.keys()):
            raise RecordError(f"{where}: item row {n} lacks one of {ROW} or the scores of {MODES}")
    for n, move in enumerate(moves):
        if not (isinstance(move, dict) and set(MOVE) <= move.keys()):
            raise RecordError(f"{where}: handoff record {n} lacks one of {MOVE}")
    return Evidence(name, run_id, int(start_time or 0), dict(metrics), dict(params), dict(tags), items, moves, where)


def is_shard(tags: dict[str, str], params: dict[str, str] | None = None) -> bool:
    """The run scored one item shard of a run (tag `shard`, src/routed.py; or params `workload.shards` > 1 with a shard
    index, whatever its tags say): judged only joined with the others (src/routed_merge.py, which writes
    `workload.shard: all`), never alone — a shard's CI is not the run's."""
    params = params or {}
    shards, index = params.get("workload.shards"), params.get("workload.shard")
    try:
        several = shards is not None and int(float(shards)) > 1
    except ValueError:
        several = True  # a shard count that is no number: not a whole run either
    return "shard" in tags or (several and index != "all")


def sampling_units(rows: list[dict], workload: str | None) -> list[str]:
    """The sampling unit of each row: its conversation where rows are turns (CLUSTERED), else the item itself. A
    ValueError names why rows cannot be judged: turns that do not say their conversation, or an item scored twice."""
    key = CLUSTERED.get(workload or "")
    if key is not None:
        missing = sum(1 for row in rows if row.get(key) is None)
        if missing:
            raise ValueError(
                f"{missing} of {len(rows)} {workload} rows do not say their {key!r}: turns of one conversation are not "
                "independent, and the gate does not judge them as if they were"
            )
        return [f"{row['task']}#{row[key]}" for row in rows]
    units = [f"{row['task']}#{row['index']}" for row in rows]
    if len(set(units)) != len(units):
        raise ValueError(f"{len(units) - len(set(units))} rows score an item already scored: not independent items")
    return units


def correct(rows: list[dict], task: str) -> tuple[np.ndarray, np.ndarray]:
    """(native, routed) correctness [N] of one task's rows under the task's metric (the all-re-prefill session is
    native)."""
    return tuple(task_scores(rows, mode).correct(METRICS[task][0]) for mode in ("native_target", "routed"))


def recomputed(run: Evidence) -> tuple[dict[str, float], bool]:
    """What the routed job would have logged from these items and handoff records (src/routed.py, as
    src/routed_merge.py recomputes a joined run), and whether its CIs are the run's own (its `eval.tasks.n_boot` and
    `seed` known): ({}, False) without items."""
    if run.items is None:
        return {}, False
    n_boot, seed = run.params.get("eval.tasks.n_boot"), run.params.get("seed")
    own = n_boot is not None and seed is not None
    boot, at = (int(n_boot), int(seed)) if own else (1, 0)  # points only: a resample of one
    metrics = quality(run.items, boot, at) | timing(run.items, boot, at) if run.items else {}
    turns = run.metrics.get("scored_turns", float(len(run.items)))
    return metrics | handoffs(run.handoffs or [], int(turns)), own


def _differ(logged: float, found: float) -> bool:
    if math.isnan(logged) and math.isnan(found):
        return False
    return not abs(logged - found) <= 1e-6 * max(1.0, abs(logged), abs(found))


def disagreements(run: Evidence, found: dict[str, float], own_cis: bool) -> list[str]:
    """Each logged metric the items contradict — 'logged K = v, the items give w' (or give none) — and each logged
    point outside its own logged CI. Without items only the latter can be checked."""
    metrics, named = run.metrics, []
    for key in TRIPLES + tuple(k.removesuffix("_low") for k in metrics if k.startswith("task.") and k.endswith("_low")):
        point, low, high = (metrics.get(key + end) for end in ("", "_low", "_high"))
        if None not in (point, low, high) and all(map(math.isfinite, (point, low, high))) and not low <= point <= high:
            named.append(f"logged {key} = {point:.4g} outside its own CI [{low:.4g}, {high:.4g}]")
    if run.items is None:
        return named
    for key in sorted(metrics):
        if not own_cis and key.endswith(("_low", "_high")):
            continue  # resampled with other settings than the run's: only its points are comparable
        if key in found and _differ(metrics[key], found[key]):
            named.append(f"logged {key} = {metrics[key]:.6g}, the items give {found[key]:.6g}")
        elif key not in found and key.startswith(CLAIMED):
            named.append(f"logged {key} = {metrics[key]:.6g}, the items give none")
    return named
