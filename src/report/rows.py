"""Tracking records as table rows, and the cell formatting every table shares.

A row is one FINISHED record flattened the way MLflow's search_runs names columns: `params.<dotted cfg key>` (under
today's key: src/records.py `current_params`), `tags.<tag>`, `metrics.<key>` (the value at the largest step), plus
`series.<key>` ({step: value}) for stepped metrics, and `record` (the record.json it came from).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

from src.records import current_params, read_record

Row = dict[str, object]
NO_INTERVAL = "(no interval: record predates samples)"  # beside a ratio of medians whose record logged none


def joined(rows: list[Row]) -> list[Row]:
    """The runs that are no item shard (tag `shard`): a shard is read only in its join (src/routed_merge.py)."""
    return [row for row in rows if "tags.shard" not in row]


def record_rows(directory: Path) -> list[Row]:
    """One row per FINISHED record.json under `directory` (failed / interrupted runs are left out), oldest first."""
    rows = []
    for path in sorted(directory.glob("**/record.json")):
        record = read_record(path)  # a truncated record, or one without a key read here, names itself
        if record.get("status", "FINISHED") != "FINISHED":
            continue
        row: Row = {"name": record["name"], "start_time": record.get("start_time") or 0, "record": str(path)}
        row |= {f"params.{k}": v for k, v in record["params"].items()}
        row |= {f"tags.{k}": v for k, v in record["tags"].items()}
        for logged in sorted(record["metrics"], key=lambda m: (m["step"] or 0, m.get("timestamp") or 0)):
            row[f"metrics.{logged['key']}"] = logged["value"]
            if logged["step"] is not None:
                row.setdefault(f"series.{logged['key']}", {})[logged["step"]] = logged["value"]
        rows.append(row)
    return sorted(rows, key=lambda row: (row["start_time"], row["name"]))


def mlflow_rows(uri: str, experiments: list[str]) -> list[Row]:
    """The same rows from an MLflow store (no series; params under today's names, as `read_record` gives them)."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    found = mlflow.search_runs(experiment_names=experiments, filter_string="attributes.status = 'FINISHED'")
    rows = []
    for run in found.sort_values("start_time").to_dict("records"):
        row = {k: v for k, v in run.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        params = current_params({k[len("params.") :]: v for k, v in row.items() if k.startswith("params.")})
        row = {k: v for k, v in row.items() if not k.startswith("params.")} | {
            f"params.{k}": v for k, v in params.items()
        }
        rows.append(row | {"name": run.get("tags.mlflow.runName"), "start_time": run["start_time"].value // 10**6})
    return rows


def fmt(value: float | None, digits: int = 1, scale: float = 1.0) -> str:
    """`value × scale` to `digits` decimals; "—" for a missing or non-finite value."""
    return "—" if value is None or not math.isfinite(value) else f"{value * scale:.{digits}f}"


def metric(row: Row, name: str) -> float:
    """The metric's value, NaN when the run did not log it."""
    return row.get(f"metrics.{name}", float("nan"))


def at_step(row: Row, name: str, step: int) -> float:
    """The stepped metric's value at `step`, NaN when absent."""
    return float(row.get(f"series.{name}", {}).get(step, math.nan))


def slashed(row: Row, names: tuple[str, ...], digits: int = 1, unit: str = "") -> str:
    """'a / b / c' of these metrics, formatted alike."""
    return " / ".join(fmt(metric(row, name), digits) for name in names) + (f" {unit}" if unit else "")


def provenance(row: Row) -> str:
    """When, at which commit and on what a record was made (from its own tags); a record made where git could not
    be read (a copy of the tree without .git) names its code by the code digest instead."""
    day = datetime.fromtimestamp(row["start_time"] / 1000, tz=UTC).strftime("%Y-%m-%d")
    commit = str(row.get("tags.git_commit", "unknown"))[:7] + (
        " (dirty)" if row.get("tags.git_dirty") == "True" else ""
    )
    if row.get("tags.git_commit", "unknown") == "unknown" and row.get("tags.code_digest"):
        commit = f"unknown, code digest {row['tags.code_digest']}"
    device = row.get("tags.gpu") or f"{row.get('tags.host')} CPU"
    return f"{day}, git {commit}, torch {row.get('tags.torch')}, transformers {row.get('tags.transformers')}, {device}"


def ratio_at_step(row: Row, name: str, step: int) -> str:
    """A stepped ratio of medians, '8.08×', with its logged 95 % interval (`<name>_lo` / `<name>_hi`: src/eval/ttft.py
    `_ratio`) where the record has one: '8.08× [7.90, 8.30]', '8.08× [—, —]' where it logged it undefined (too few
    repeats); the bare ratio for a record that predates them (`has_intervals`)."""
    point = f"{fmt(at_step(row, name, step), 2)}×"
    if not has_intervals(row, name):
        return point
    return f"{point} [{fmt(at_step(row, f'{name}_lo', step), 2)}, {fmt(at_step(row, f'{name}_hi', step), 2)}]"


def has_intervals(row: Row, name: str) -> bool:
    """Whether the record logged the stepped ratio `name` with its interval (handoff records from kept samples on)."""
    return f"series.{name}_lo" in row
