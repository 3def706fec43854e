"""Hand-made routed runs for the gate's tests: item rows in the routed job's format (src/routed_runs.py `item_row`), the
handoff records beside them, and the metrics the routed job would log from them (src/routed.py), so that a test plants
exactly one fault — a logged metric, a missing key, a re-run — into an otherwise consistent record."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from src.gate_evidence import Evidence
from src.routed import handoffs, quality, timing

RIGHT, WRONG = [[-0.1, 1.0], [-2.0, 0.0]], [[-2.0, 0.0], [-0.1, 1.0]]  # label 0: argmax right / wrong (acc, acc_norm)
REAL = {"weights": "real", "job": "routed", "workload": "fewshot", "direction": "small_to_large", "split": "test"}
PARAMS = {"eval.tasks.n_boot": "200", "seed": "0", "pair.dtype": "float32"}
KINDS = ("artifact_mismatch", "nonfinite_map", "nonfinite_source", "beyond_length", "failed_guard")
_clock, _ids = itertools.count(1_800_000_000_000, 1000), itertools.count()


def row(task: str, index: int, native: bool, routed: bool, speedup: float = 3.0, **extra) -> dict:
    """One scored item: native (all-re-prefill) and routed right or wrong, the source right, a mapped handoff whose
    routed TTFT is 10 ms and re-prefill 10·speedup (+ a little per item, so medians have a spread)."""
    scores = {"native_target": RIGHT if native else WRONG, "routed": RIGHT if routed else WRONG, "native_source": RIGHT}
    move = {"sender": "source", "receiver": "target", "path": "map", "status": "applied", "context": 80, "hit": 0}
    move |= {"prefill_fraction": 0.0, "bytes": 100}
    ttft = {"routed": 10.0 + 0.01 * (index % 7), "reprefill": 10.0 * speedup + 0.01 * (index % 11), "hit": 9.0}
    item = {"task": task, "index": index, "label": 0, "lengths": [2, 3], "history_tokens": 80, "turn_tokens": 10}
    nll = {mode: 0.1 if s is RIGHT else 2.0 for mode, s in scores.items()}
    return item | {"scores": scores, "nll": nll, "ttft": ttft, "handoff": move} | extra


def task_rows(task: str, n: int, lost: int = 0, gained: int = 0, **extra) -> list[dict]:
    """n items of one task: the first `lost` the routed session got wrong, the next `gained` only it got right."""
    return [row(task, i, native=i >= lost + gained or i < lost, routed=i >= lost, **extra) for i in range(n)]


def logged(items: list[dict], moves: list[dict] | None = None, params: dict = PARAMS) -> dict[str, float]:
    """What the routed job logs for these rows (and handoff records: default, each row's): quality, timing, handoffs,
    every rollback kind held."""
    moves = [item["handoff"] for item in items] if moves is None else moves
    n_boot, seed = int(params["eval.tasks.n_boot"]), int(params["seed"])
    metrics = (quality(items, n_boot, seed) | timing(items, n_boot, seed)) if items else {}
    metrics |= handoffs(moves, len(items)) | {"scored_turns": float(len(items))}
    return metrics | {f"rollback.{kind}": 1.0 for kind in KINDS} | {"rollback_verified": 1.0}


def run(
    items: list[dict],
    metrics: dict | None = None,
    tags: dict = REAL,
    params: dict = PARAMS,
    moves: list[dict] | None = None,
    start: int | None = None,
) -> Evidence:
    """A finished run of these rows; `metrics` (default: what the job logs for them) replaces the logged ones."""
    moves = [item["handoff"] for item in items] if moves is None else moves
    metrics = logged(items, moves, params) if metrics is None else metrics
    start = next(_clock) if start is None else start
    return Evidence(
        f"planted_{next(_ids)}", f"id{next(_ids):08d}", start, metrics, dict(params), dict(tags), items, moves
    )


def passing(n: int = 100, **extra) -> list[dict]:
    """Two tasks of n items each, routed = native on every item, handoffs 3× faster, 1 in 8 also timed in-session."""
    return [
        item | ({"ttft": item["ttft"] | {"same_work": item["ttft"]["reprefill"] * 1.01}} if i % 8 == 0 else {})
        for i, item in enumerate(task_rows("arc_easy", n, **extra) + task_rows("boolq", n, **extra))
    ]


def write_record(folder: Path, planted: Evidence) -> Path:
    """The planted run as a JSON tracking record (record.json, artifacts/routed/items.json) under `folder`."""
    where = folder / planted.run_id
    (where / "artifacts/routed").mkdir(parents=True)
    metrics = [{"key": k, "value": v, "step": None, "timestamp": 0} for k, v in planted.metrics.items()]
    record = {"name": planted.name, "experiment": "routed", "status": "FINISHED", "start_time": planted.start_time}
    record |= {"end_time": planted.start_time + 1, "params": planted.params, "tags": planted.tags, "metrics": metrics}
    (where / "record.json").write_text(json.dumps(record))
    document = {"items": planted.items, "handoffs": planted.handoffs, "policy": "map"}
    (where / "artifacts/routed/items.json").write_text(json.dumps(document))
    return where
