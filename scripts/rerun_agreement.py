"""Does a re-run of routed runs give the same per-item answers? Two folders of run records (e.g. a lease's re-run and
the committed records of the same runs): the runs are paired by folder name (a run's name and config digest), their
items by (task, index); per scored path (routed, native target, native source) it counts the items whose answer (the
arg-max choice) differs, with the winning margin of each such item in the first folder, and the largest change of any
choice's score. A pair whose items differ in order or identity is an error naming the run — never a silent partial
comparison; runs that did not finish in the first folder (a cut shard) are listed and left out.

    python scripts/rerun_agreement.py /tmp/gate7/trk results/gate-h100-2026-12-06b --out agreement.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from src.records import RecordError, read_items, read_record, rows_with  # noqa: E402


def answer(choices: list) -> tuple[int, float]:
    """The arg-max choice of one path's per-choice [score, …] rows and its margin over the runner-up."""
    scores = [row[0] for row in choices]
    best = max(range(len(scores)), key=scores.__getitem__)
    runner_up = max((s for n, s in enumerate(scores) if n != best), default=float("-inf"))
    return best, scores[best] - runner_up


def compare(first: list[dict], second: list[dict], where: str) -> dict:
    """Per path: items, answers that differ (with the first run's margin on each), the largest |Δ score|."""
    keys = [(row["task"], row["index"]) for row in first]
    if keys != [(row["task"], row["index"]) for row in second]:
        raise RecordError(f"{where}: the two runs hold different items (or in another order): not a re-run")
    out: dict[str, dict] = {}
    for a, b in zip(first, second, strict=True):
        if set(a["scores"]) != set(b["scores"]):
            raise RecordError(f"{where}: item {a['task']}:{a['index']} scores paths {sorted(a['scores'])} vs "
                              f"{sorted(b['scores'])}")  # fmt: skip
        for path, choices in a["scores"].items():
            entry = out.setdefault(path, {"items": 0, "differ": 0, "margins": [], "max_abs_score_change": 0.0})
            (mine, margin), (theirs, _) = answer(choices), answer(b["scores"][path])
            entry["items"] += 1
            if mine != theirs:
                entry["differ"] += 1
                entry["margins"].append(margin)
            change = max(abs(x[0] - y[0]) for x, y in zip(choices, b["scores"][path], strict=True))
            entry["max_abs_score_change"] = max(entry["max_abs_score_change"], change)
    return out


def agreement(first: Path, second: Path) -> dict:
    """Every finished run of `first` against the run of the same folder name in `second`, summed per path."""
    runs, cut, mine, theirs = [], [], [], []
    for folder in sorted(p for p in first.iterdir() if (p / "record.json").is_file()):
        if read_record(folder / "record.json")["status"] != "FINISHED":
            cut.append(folder.name)
            continue
        other = second / folder.name
        if not (other / "record.json").is_file():
            raise RecordError(f"{other}: no record of run {folder.name} to compare with")
        keys = ("task", "index", "scores")
        a, b = rows_with(read_items(folder), keys, folder), rows_with(read_items(other), keys, other)
        runs.append({"run": folder.name, "paths": compare(a, b, folder.name)})
        mine, theirs = mine + a, theirs + b
    if not runs:
        raise RecordError(f"{first}: no finished run record to compare")
    total = compare(mine, theirs, str(first))  # every run's items, paired as above
    return {"first": str(first), "second": str(second), "runs": runs, "not_finished": cut, "total": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path, help="a folder of run folders (record.json + artifacts/routed/items)")
    parser.add_argument("second", type=Path, help="the folder holding the same runs' earlier records")
    parser.add_argument("--out", type=Path, help="write the comparison as JSON here")
    args = parser.parse_args()
    try:
        result = agreement(args.first, args.second)
    except (RecordError, OSError, ValueError) as error:
        sys.exit(f"rerun_agreement: {error}")
    for path, entry in result["total"].items():
        margins = ", ".join(f"{m:.3g}" for m in entry["margins"]) or "—"
        print(f"{path}: {entry['differ']} of {entry['items']} answers differ (their margins: {margins}); "
              f"largest |Δ score| {entry['max_abs_score_change']:.3g}")  # fmt: skip
    if result["not_finished"]:
        print(f"not finished in {args.first} (left out): {', '.join(result['not_finished'])}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
