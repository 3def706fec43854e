"""Join the item shards of one routed run into the run: `python -m src.routed_merge OUT RECORD_DIR…`.

A device call lasts at most 10 minutes, fewer than the items a ±2-point CI needs; so the routed job scores item shard
`workload.shard` of `workload.shards` per call (src/routed_workloads.py `shard`: per task, the items ≡ shard mod
shards) and each call writes its own record (tag `shard` = "i/n"), which the gate never judges alone. This joins
them: every shard present once, each finished, the same code (`code_digest`: the commits may differ, so one run's
shards may span leases), models, mapper, machine and config but the shard index, no
item scored twice, each shard's rows whole (every key the join reads, and as many items per task and handoffs per
status as the shard's own record logged: a lost or added row is refused, naming the shard and both counts); the
per-item rows and handoff records concatenated; every metric the run's items carry recomputed
from them as the routed job computes it (quality with paired CIs, TTFT and the speedup's CI, the harness check,
handoffs); the rest joined by what it means — rollback holds only where it held in every shard (the largest cache
difference), throughput from the summed counts and seconds, fidelity the mean over shards (each on its own first
prompts). A metric it does not know how to join is an error, never carried over silently. The joined record is a JSON
record (as `tracking.backend=json` writes) under OUT, written whole or not at all; `python -m src.tracking import OUT`
brings it into MLflow beside its shards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

from src.eval.read_error import read_error_metrics
from src.records import (
    ITEMS,
    RecordError,
    items_of,
    items_path,
    metric_values,
    read_json,
    read_record,
    record_digest,
    record_dir,
    require,
    rows_with,
)
from src.routed import handoffs, quality, timing

SHARD_PARAMS = ("workload.shard", "tracking.json_dir")  # the only params shards of one run may differ in
# the only tags they may differ in besides `shard`: the commit a lease's copy of the tree named — its code is the
# `code_digest` (src/, conf/, kernels/ by content), which every shard must carry and share, so shards of one run may
# come from several leases whose commits changed only docs, tests or scripts
COMMIT_TAGS = ("git_commit", "git_dirty")
RECOMPUTED = ("task.", "ttft.", "ttft_speedup", "gpu_peak_mb.", "handoffs.", "refusals.", "handoff_frequency",
              "prefill_fraction", "mapped_bytes_per_handoff", "read_error.")  # fmt: skip  # from the items and handoff records
ITEM_KEYS = ("task", "index", "label", "lengths", "history_tokens", "turn_tokens", "scores", "nll", "ttft", "handoff")
HANDOFF_KEYS = ("sender", "receiver", "status", "path", "context", "hit", "prefill_fraction", "bytes")  # what it reads


def _shard(tags: dict[str, str], where: Path) -> tuple[int, int]:
    """The record's shard (index, count), from its `shard` tag "i/n"; a RecordError when it is no shard."""
    text = str(require(tags, "shard", where))
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise RecordError(f"{where}: shard tag {text!r} is not 'index/count'") from None
    return index, count


def _check_parts(records: list[dict], paths: list[Path]) -> int:
    """The shard count, once every shard 0..n−1 is here exactly once, finished, and alike in all but its index."""
    first, where = records[0], paths[0]
    shards = [_shard(r["tags"], p) for r, p in zip(records, paths, strict=True)]
    count = shards[0][1]
    if sorted(shards) != [(i, count) for i in range(count)]:
        raise ValueError(f"shards {sorted(f'{i}/{n}' for i, n in shards)} are not each of 0..{count - 1} of {count} "
                         f"exactly once")  # fmt: skip
    for record, path in zip(records, paths, strict=True):
        if record.get("status") != "FINISHED":
            raise ValueError(f"{path}: status {record.get('status')!r}: only finished shards join")
        if not record["tags"].get("code_digest"):
            raise ValueError(f"{path}: no code_digest tag: shards join only where their code is known to be one")
        tags = {k: v for k, v in record["tags"].items() if k not in ("shard", *COMMIT_TAGS)}
        expected = {k: v for k, v in first["tags"].items() if k not in ("shard", *COMMIT_TAGS)}
        if differ := sorted(k for k in tags.keys() | expected.keys() if tags.get(k) != expected.get(k)):
            raise ValueError(f"{path} and {where} differ in tags {differ}: not shards of one run")
        params = {k: v for k, v in record["params"].items() if k not in SHARD_PARAMS}
        expected = {k: v for k, v in first["params"].items() if k not in SHARD_PARAMS}
        if differ := sorted(k for k in params.keys() | expected.keys() if params.get(k) != expected.get(k)):
            raise ValueError(f"{path} and {where} differ in params {differ}: not shards of one run")
    return count


def _rows(document: object, logged: dict[str, float], path: Path, shard: str) -> tuple[list[dict], list[dict]]:
    """The shard's item rows and handoff records, each holding the keys the join reads, and as many as the shard's
    own record logged (`task.<task>.items` per task; `handoffs.*` recomputed from its handoff records); a RecordError
    naming the file and row, or a ValueError naming the shard and both counts."""
    where = items_path(path)
    items = rows_with(items_of(document, where), ITEM_KEYS, f"{where} items")
    moves = rows_with(require(document, "handoffs", where), HANDOFF_KEYS, f"{where} handoffs")
    for n, row in enumerate(items):
        if not isinstance(row["task"], str) or isinstance(row["index"], bool) or not isinstance(row["index"], int):
            raise RecordError(f"{where} items[{n}]: task {row['task']!r} and index {row['index']!r} are not a name and "
                              "an item number")  # fmt: skip
    rows = Counter(row["task"] for row in items)
    counts = {key[len("task.") : -len(".items")]: value for key, value in logged.items()
              if key.startswith("task.") and key.endswith(".items") and not key.startswith("task.mean.")}  # fmt: skip
    for task in sorted(rows.keys() | counts.keys(), key=str):
        if rows.get(task, 0) != counts.get(task, 0):
            raise ValueError(f"{path}: shard {shard} holds {rows.get(task, 0)} item rows of {task}, its record logged "
                             f"task.{task}.items = {counts.get(task, 0):g}: a row was lost or added (rerun the shard)")  # fmt: skip
    recounted = {k: v for k, v in handoffs(moves, 1).items() if k.startswith("handoffs.")}
    own = {k: v for k, v in logged.items() if k.startswith("handoffs.")}
    if differ := sorted(k for k in recounted.keys() | own.keys() if recounted.get(k, 0) != own.get(k, 0)):
        shown = ", ".join(f"{k} {recounted.get(k, 0):g} (logged {own.get(k, 0):g})" for k in differ)
        raise ValueError(f"{path}: shard {shard}'s handoff records count {shown}: a record was lost or added (rerun the "
                         "shard)")  # fmt: skip
    return items, moves


def _joined(key: str, values: list[float], shards: int) -> float:
    """A metric no item carries, joined over the shards by what it means; a ValueError when it has no rule."""
    if key.startswith("rollback") and key.endswith(".cache_max_abs_diff"):
        return max(values)
    if key.startswith("rollback"):  # 1.0 where the replay held: held in every shard
        return min(values)
    if key.startswith("fidelity."):
        return sum(values) / len(values)
    if key == "gpu_peak_memory_mb":
        return max(values)
    if key == "scored_turns" or key.startswith("throughput.") and (key.endswith("_seconds") or key in
                                                                    ("throughput.items", "throughput.tokens")):  # fmt: skip
        return sum(values)
    raise ValueError(f"metric {key!r}: the merge has no rule to join it over {shards} shards")


def interleave(parts: list[list[dict]]) -> list[dict]:
    """The unsharded run's item order from its shards' rows (shard 0 first): per task, in the order tasks first
    appear, position p of shard i is the task's item p·n + i (`routed_workloads.shard`) — so the bootstrap CIs, which
    resample items in order, are the unsharded run's."""
    tasks = list(dict.fromkeys(row["task"] for part in parts for row in part))
    joined = []
    for task in tasks:
        mine = [[row for row in part if row["task"] == task] for part in parts]
        for position in range(max(len(rows) for rows in mine)):
            joined += [rows[position] for rows in mine if position < len(rows)]
    return joined


def merge(paths: list[Path]) -> tuple[dict, dict]:
    """The joined record (name, params, tags, metrics…) and its items artifact, from the shards' record folders."""
    if not paths:
        raise ValueError("name the record folders of every shard of the run")
    records = [read_record(p / "record.json") for p in paths]
    shards = _check_parts(records, paths)
    order = sorted(range(len(paths)), key=lambda n: _shard(records[n]["tags"], paths[n]))
    records, paths = [records[n] for n in order], [paths[n] for n in order]  # shard 0 first
    documents = [read_json(items_path(p)) for p in paths]
    values = [metric_values(r, p) for r, p in zip(records, paths, strict=True)]
    parts = [_rows(document, logged, p, r["tags"]["shard"])
             for document, logged, p, r in zip(documents, values, paths, records, strict=True)]  # fmt: skip
    items = interleave([rows for rows, _ in parts])
    moves = [move for _, rows in parts for move in rows]
    keys = [(row["task"], row["index"]) for row in items]
    if len(set(keys)) != len(keys):
        raise ValueError(f"shards overlap: {len(keys) - len(set(keys))} items scored twice")
    params = records[0]["params"]
    n_boot, seed = int(params["eval.tasks.n_boot"]), int(params["seed"])
    everywhere = set.intersection(*(set(v) for v in values))
    turns = sum(v["scored_turns"] for v in values) if "scored_turns" in everywhere else None
    if turns is None:
        raise ValueError("a shard lacks the metric 'scored_turns' (records before shards existed cannot join)")
    metrics = quality(items, n_boot, seed) | timing(items, n_boot, seed) | handoffs(moves, int(turns))
    metrics |= read_error_metrics(items, n_boot, seed)  # {} unless the shards collected it
    for key in sorted(set().union(*values) - metrics.keys()):
        if key.startswith(RECOMPUTED):
            continue  # a bucket the joined items no longer have in this form: recomputed above or absent
        if key.endswith(("_items_per_s", "_tokens_per_s")):
            continue  # rates: from the summed counts below
        if key not in everywhere:
            raise ValueError(f"metric {key!r} is logged by some shards only: not one run's")
        metrics[key] = _joined(key, [v[key] for v in values], shards)
    for kind in ("routed", "reprefill"):
        seconds = metrics.get(f"throughput.{kind}_seconds")
        if seconds:
            for unit, count in (("items_per_s", "throughput.items"), ("tokens_per_s", "throughput.tokens")):
                metrics[f"throughput.{kind}_{unit}"] = metrics[count] / seconds
    names = [r["name"] for r in records]
    name = names[0].rsplit(":shard", 1)[0] + f":shards{shards}"
    commits = sorted({r["tags"].get("git_commit", "") for r in records})
    tags = {k: v for k, v in records[0]["tags"].items() if k != "shard"} | {
        "merged_shards": str(shards),
        "merged_from": ",".join(sorted(names)),
        "merged_commits": ",".join(commits),  # one code_digest; the commits its leases' trees named
        "git_dirty": str(any(r["tags"].get("git_dirty") == "True" for r in records)),
    }
    record = {
        "name": name,
        "experiment": records[0]["experiment"],
        "status": "FINISHED",
        "start_time": min(r["start_time"] for r in records),
        "end_time": max(r["end_time"] for r in records),
        "params": params | {"workload.shard": "all"},
        "tags": tags,
        "metrics": [{"key": k, "value": float(v), "step": None, "timestamp": 0} for k, v in sorted(metrics.items())],
    }
    policy = require(documents[0], "policy", paths[0])
    return record, {"items": items, "handoffs": moves, "policy": policy, "shards": sorted(names)}


def write(out: Path, record: dict, document: dict, config: Path) -> Path:
    """The joined record folder under `out` (record.json, artifacts: items, the config of shard 0), atomically."""
    final = record_dir(out, record["name"], record_digest(record["params"]))
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out, prefix=".merge-"))
    try:
        (staging / ITEMS).parent.mkdir(parents=True)
        (staging / ITEMS).write_text(json.dumps(document, separators=(",", ":"), default=str))
        note = f"# joined from {record['tags']['merged_shards']} shards (src/routed_merge.py); workload.shard: all\n"
        (staging / "artifacts/config.yaml").write_text(note + config.read_text())
        (staging / "record.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Join the item shards of one routed run into one record.")
    parser.add_argument("out", type=Path, help="folder of JSON records to write the joined run into")
    parser.add_argument("records", nargs="+", type=Path, help="the record folder of every shard")
    args = parser.parse_args(argv)
    try:
        record, document = merge(args.records)
        final = write(args.out, record, document, args.records[0] / "artifacts/config.yaml")
    except (ValueError, KeyError) as error:  # RecordError is a ValueError
        print(f"routed_merge: {error}", file=sys.stderr)
        return 2
    metrics = {m["key"]: m["value"] for m in record["metrics"]}
    print(f"{final}: {len(document['items'])} items from {record['tags']['merged_shards']} shards")
    for key in ("task.mean.loss_points", "task.mean.loss_points_low", "task.mean.loss_points_high", "ttft_speedup",
                "ttft_speedup_low", "ttft_speedup_high", "rollback_verified"):  # fmt: skip
        if key in metrics:
            print(f"  {key:<32} {metrics[key]:10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
