"""Length evidence: how long a history a mapper was measured to serve, written into its manifest.

    python -m src.length_evidence MAPPER_DIR RECORD… [--edges 1024,2048,4096] [--margin 1.0] [--min-items 300]

Each RECORD is a routed run (a record folder or its record.json, src/tracking.py) of a single-turn workload
(fewshot, fewshot_long, passage) on VALIDATION items (tag split=valid: a run on test items is refused — test items
never choose a threshold) with real weights, the pair and the very coefficients of the mapper (tags: fingerprints,
tokenizer hash, mapper_tensor_sha256). Its items (artifacts/routed/items.json: each row readable and each item
once, `checked_items`, or the run is refused) are binned by history length (`--edges`, default conf/gate/default.yaml
length_edges: bins (0, e₁], (e₁, e₂], …, and past the last edge), and per run × bin the loss in points of the routed
session against the native receiver on the items it MAPPED (a refused handoff re-prefilled: counted, left out) is
measured with the run's paired bootstrap CI (src/routed.py `mean_difference_ci`: mean over tasks, items resampled
within each task; the run's own n_boot and seed). The mapper's `max_verified_length` follows from them by
src/artifact.py `verified_length` (a non-inferiority reading: ≥ min_items mapped items and the CI's upper bound ≤ the
margin, from the shortest bin up, no gap). The evidence replaces any the manifest had and names the coefficients it
was measured on (their tensor_sha256: a save with other coefficients drops it, a load refuses it on others); the
artifact is published again atomically (a new version whose id verifies the evidence with the rest of the manifest),
and the table is printed. The session's length guard (`Policy.length_guard=evidence`) then refuses to map a history
past `max_verified_length`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from src.artifact import EVIDENCE, amend_manifest, load_mapper, passes, verified_length
from src.gate import DEFAULTS
from src.records import RecordError, items_path, read_items, read_record, require, rows_with
from src.routed import mean_difference_ci
from src.routed_runs import task_scores
from src.routed_workloads import WORKLOADS, play_single_turn
from src.tasks import METRICS

LEVERS = "policy.levers."
ITEM_KEYS = ("task", "index", "label", "lengths", "history_tokens", "turn_tokens", "scores", "handoff")  # what it reads


def bins(edges: list[int]) -> list[tuple[int, int | None]]:
    """(low, high] per edge, then (last edge, None): every history length falls in exactly one."""
    if not edges or any(not isinstance(e, int) or isinstance(e, bool) for e in edges) or edges[0] < 1:
        raise ValueError(f"length edges must be positive integers, not {edges!r}")
    if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"length edges must increase strictly, not {edges!r}")
    return [*zip([0, *edges[:-1]], edges, strict=True), (edges[-1], None)]


def checked_items(items: list[dict], where: Path) -> list[dict]:
    """The run's item rows, each holding what a measurement reads — a known task, whole numbers where it counts
    (index, label, history and turn tokens), numeric choice lengths and scores, a handoff's path and status — and each
    item (task, index) once; else a RecordError naming the file, the row and the value. An item listed twice is
    refused, not deduplicated: the routed job writes each item once, so a second row means a damaged or hand-made
    record, and no rule says which copy is the measurement (counting both would pass the min_items bar on fewer
    items)."""
    first: dict[tuple[str, int], int] = {}
    for n, row in enumerate(rows_with(items, ITEM_KEYS, f"{where} items")):
        at = f"{where} items[{n}]"
        if not isinstance(row["task"], str) or row["task"] not in METRICS:
            raise RecordError(f"{at}: task {row['task']!r} is not one of the tasks (src/tasks.py METRICS)")
        for key in ("index", "label", "history_tokens", "turn_tokens"):
            if isinstance(row[key], bool) or not isinstance(row[key], int) or row[key] < 0:
                raise RecordError(f"{at}: {key} {row[key]!r} is not a whole number ≥ 0")
        scores = row["scores"]
        pairs = [scores.get(mode) for mode in ("native_target", "routed")] if isinstance(scores, dict) else [None]
        numbers = [row["lengths"], *(value for pair in pairs for value in (pair or [None]))]
        if not all(isinstance(v, list) and v and all(_number(x) for x in v) for v in numbers):
            raise RecordError(f"{at}: lengths {row['lengths']!r} or the scores of native_target / routed are not "
                              "lists of numbers")  # fmt: skip
        handoff = row["handoff"]
        if not isinstance(handoff, dict) or not {"path", "status"} <= handoff.keys():
            raise RecordError(f"{at}: handoff {handoff!r} is not a handoff record with its path and status")
        key = (row["task"], row["index"])
        if key in first:
            raise RecordError(f"{at}: item {key} is listed twice (first at items[{first[key]}]): each item counts once "
                              "toward min_items; a record that lists one twice is damaged (refused, not deduplicated)")  # fmt: skip
        first[key] = n
    return items


def _number(value: object) -> bool:
    """A JSON number (a greedy flag may be a bool), or a [log p, greedy] pair of them."""
    if isinstance(value, list):
        return len(value) == 2 and all(_number(x) for x in value)
    return isinstance(value, int | float) and not math.isnan(value)


def _checked(path: Path, manifest: dict) -> tuple[Path, dict]:
    """(record folder, record) of a routed run that may show this mapper's length evidence, or a ValueError naming
    the record and what rules it out."""
    folder = path.parent if path.name == "record.json" else path
    record = read_record(folder / "record.json")
    tags = record["tags"]
    where = folder / "record.json"
    if record.get("status") != "FINISHED":
        raise ValueError(f"{where}: status {record.get('status')!r}, not FINISHED")
    if tags.get("job") != "routed" or tags.get("workload") not in WORKLOADS:
        raise ValueError(
            f"{where}: not a routed workload run (job {tags.get('job')!r}, workload {tags.get('workload')!r})"
        )
    if WORKLOADS[tags["workload"]].play is not play_single_turn:
        raise ValueError(f"{where}: workload {tags['workload']!r} hands off more than once per item; length evidence "
                         "reads single-turn workloads (one history, one handoff per item)")  # fmt: skip
    if tags.get("split") != "valid":
        raise ValueError(
            f"{where}: a run on {tags.get('split') or 'unnamed'} items (tag split={tags.get('split')}): test items "
            "never choose a threshold — length evidence reads validation runs only (workload.split=valid)"
        )
    if tags.get("weights") != "real":
        raise ValueError(f"{where}: weights {tags.get('weights')!r}: random weights make no quality claim")
    identity = {
        "source_fingerprint": "source_fingerprint",
        "target_fingerprint": "target_fingerprint",
        "tokenizer_hash": "tokenizer_hash",
        "mapper_tensor_sha256": "tensor_sha256",
    }
    for tag, key in identity.items():
        if tags.get(tag) != manifest.get(key):
            raise ValueError(
                f"{where}: ran another mapper than this one: {tag} {str(tags.get(tag))[:12]} ≠ the manifest's "
                f"{key} {str(manifest.get(key))[:12]}"
                + (" (routed runs record it since the length evidence came in: rerun)" if tag not in tags else "")
            )
    return folder, record


def measure(path: Path, manifest: dict, edges: list[int]) -> list[dict]:
    """The run's measurements, one per history-length bin it reached (module docstring)."""
    folder, record = _checked(path, manifest)
    params, tags = record["params"], record["tags"]
    where = folder / "record.json"
    n_boot, seed = int(require(params, "eval.tasks.n_boot", where)), int(require(params, "seed", where))
    items = checked_items(read_items(folder), items_path(folder))
    rows = []
    for low, high in bins(edges):
        inside = [i for i in items if low < i["history_tokens"] and (high is None or i["history_tokens"] <= high)]
        if not inside:
            continue
        mapped = [i for i in inside if (i["handoff"]["path"], i["handoff"]["status"]) == ("map", "applied")]
        tasks = sorted({i["task"] for i in mapped})
        pairs = {}
        for task in tasks:
            rows_of = [i for i in mapped if i["task"] == task]
            native, routed = (
                task_scores(rows_of, mode).correct(METRICS[task][0]) for mode in ("native_target", "routed")
            )
            pairs[task] = (native, routed)
        loss = mean_difference_ci(pairs, n_boot, seed) if pairs else None
        rows.append({
            "bin": [low, high],
            "length": max((i["history_tokens"] for i in mapped), default=0),  # the longest history it mapped
            "items": len(mapped),
            "refused": len(inside) - len(mapped),
            "tasks": tasks,
            "loss_points": None if loss is None else 100 * loss.estimate,
            "loss_points_low": None if loss is None else 100 * loss.low,
            "loss_points_high": None if loss is None else 100 * loss.high,
            "workload": tags["workload"],
            "split": tags["split"],
            "run": record["name"],
            "run_id": folder.name,
            "record": str(where),
            "policy": tags.get("policy"),
            "dtype": params.get("pair.dtype"),
            "levers": {k[len(LEVERS) :]: v for k, v in sorted(params.items()) if k.startswith(LEVERS)},
        })  # fmt: skip
    return rows


def evidence(measurements: list[dict], edges: list[int], margin: float, min_items: int, tensor_sha256: str) -> dict:
    """The manifest's length evidence block: the rule's settings, the measurements, what they verify, and the
    coefficients they were measured on (`tensor_sha256`: a mapper saved with other coefficients loses it)."""
    if not (isinstance(margin, int | float) and math.isfinite(margin) and margin >= 0):
        raise ValueError(f"the margin must be a finite number of points ≥ 0, not {margin!r}")
    if isinstance(min_items, bool) or not isinstance(min_items, int) or min_items < 1:
        raise ValueError(f"min_items must be an integer ≥ 1, not {min_items!r}")
    length, shown = verified_length(measurements, margin, min_items)
    return {
        "rule": "non-inferiority: ≥ min_items mapped items and the paired 95 % CI's upper bound of the loss (native "
        "receiver − routed, points) ≤ margin_points, bins from the shortest measured up without a gap; "
        "max_verified_length: the longest history mapped in the last verified bin (src/artifact.py verified_length)",
        "margin_points": float(margin),
        "min_items": min_items,
        "edges": list(edges),
        "measurements": sorted(measurements, key=lambda r: (r["bin"][0], r["run_id"])),
        "max_verified_length": length,
        "verified_by": None if shown is None else f"{shown['run_id']} ({shown['record']})",
        "tensor_sha256": tensor_sha256,
    }


def add_evidence(directory: Path, records: list[Path], edges: list[int], margin: float, min_items: int) -> dict:
    """Measure the records against the mapper at `directory` and publish its manifest with the evidence (replacing
    any it had), atomically; returns the evidence block as loaded back (verified)."""
    manifest = load_mapper(directory).manifest
    folders = [(p.parent if p.name == "record.json" else p).resolve() for p in map(Path, records)]
    if len(set(folders)) != len(folders):
        raise ValueError("a record was given twice: each run is one measurement")
    measurements = [row for path in records for row in measure(Path(path), manifest, edges)]
    if not measurements:
        raise ValueError("the records hold no scored item: nothing was measured")
    block = evidence(measurements, edges, margin, min_items, manifest["tensor_sha256"])
    return amend_manifest(directory, {EVIDENCE: block}).manifest[EVIDENCE]


def table(block: dict) -> str:
    """The evidence as a Markdown table, one row per run × bin, and what it verifies."""
    lines = [
        f"loss = native receiver − routed on mapped items, points [paired 95 % CI]; verified: ≥ {block['min_items']} "
        f"mapped items and CI upper bound ≤ {block['margin_points']:g} point(s)",
        "| history tokens | longest mapped | mapped | refused | loss points [95 % CI] | verified | run |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in block["measurements"]:
        low, high = row["bin"]
        span = f"({low}, {high}]" if high is not None else f"> {low}"
        ok = passes(row, block["margin_points"], block["min_items"])
        loss = "—" if row["loss_points"] is None else f"{row['loss_points']:.2f} [{row['loss_points_low']:.2f}, "
        loss += "" if row["loss_points"] is None else f"{row['loss_points_high']:.2f}]"
        lines.append(
            f"| {span} | {row['length']} | {row['items']} | {row['refused']} | {loss} | {'yes' if ok else 'no'} "
            f"| {row['run_id']} |"
        )
    by = block["verified_by"] or "no measured length passed: every map is refused under length_guard=evidence"
    lines.append(f"\nmax_verified_length: {block['max_verified_length']} tokens ({by})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mapper", type=Path, help="the mapper artifact directory (its manifest gets the evidence)")
    parser.add_argument("records", nargs="+", type=Path, help="routed run folders (or their record.json)")
    parser.add_argument("--edges", help="history-length bin edges, comma-separated (default: conf/gate length_edges)")
    parser.add_argument("--margin", type=float, default=DEFAULTS.max_loss_points, help="points (default: the gate's)")
    parser.add_argument("--min-items", type=int, default=DEFAULTS.min_length_items, help="mapped items per bin")
    args = parser.parse_args()
    try:
        edges = list(DEFAULTS.length_edges)
        if args.edges:
            if not all(e.strip().isdigit() for e in args.edges.split(",")):
                raise ValueError(f"--edges takes comma-separated token counts, not {args.edges!r}")
            edges = [int(e) for e in args.edges.split(",")]
        block = add_evidence(args.mapper, args.records, edges, args.margin, args.min_items)
    except ValueError as error:  # a record or mapper that cannot show evidence (RecordError, ArtifactError too)
        sys.exit(f"length_evidence: {error}")
    print(table(block))
    print(f"written to {(args.mapper / 'current').resolve()} (the mapper's new version)")


if __name__ == "__main__":
    main()
