"""How many items per task a routed run's quality verdict still needs, as the gate judges it (src/gate_criteria.py):
per task the items (or conversations, where turns cluster), how many differ between the routed and the all-native
answer, the loss with Tango's 95 % interval, the verdict against the margin (conf/gate/default.yaml max_loss_points),
and, where it is UNDERPOWERED, the items still to score for 80 % power at the planned true loss (planned_loss_points:
a stated effect, 0 — never the run's noisy observed loss) at the run's share of differing items — a plan for the next
run, read off a run's per-item scores.

    python scripts/items_needed.py results/routed4-h200-2026-12-04/qwen25coder_0p5b_to_1p5b_routed_fewshot_*
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from src.gate_criteria import still_needed, task_verdicts, thresholds  # noqa: E402
from src.gate_evidence import evidence  # noqa: E402
from src.records import RecordError, items_path, metric_values, read_json, read_record  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (record.json + artifacts/routed/items.json)")
    parser.add_argument("--margin", type=float, help="non-inferiority margin in points (default: the gate's)")
    args = parser.parse_args()
    limits = thresholds(max_loss_points=args.margin)
    for folder in args.runs:
        try:
            record = read_record(folder / "record.json")
            metrics = metric_values(record, folder)
            items = items_path(folder)
            run = evidence(record["name"], folder.name, 0, metrics, record["params"], record["tags"],
                           read_json(items), str(items))  # fmt: skip
            found = task_verdicts(run, limits)
        except (RecordError, ValueError) as error:
            sys.exit(f"items_needed: {folder}: {error}")
        for task, counts, verdict in found:
            units = "conversations" if counts.clustered else "items"
            more = still_needed(counts, limits) if verdict.status == "UNDERPOWERED" else 0
            plan = f"; ≈ {more} more {units} for {limits.power:.0%} power at a true loss of 0" if more > 0 else ""
            print(
                f"{folder.name} {task}: {counts.units} {units}, {counts.lost + counts.gained} differ, loss "
                f"{verdict.loss:+.2f} [{verdict.low:+.2f}, {verdict.high:+.2f}] pt vs margin "
                f"{limits.max_loss_points:g}: {verdict.status}{plan}"
            )


if __name__ == "__main__":
    main()
