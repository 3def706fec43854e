"""How many items per task a routed run's quality verdict needs: the share of items whose routed and all-native
answers differ (a paired difference's variance comes only from them), the run's loss with its non-inferiority verdict
against the gate's margin (conf/gate/default.yaml max_loss_points), and, where it is UNDERPOWERED, the items at which
the paired 95 % CI would clear the margin if the observed loss held (src/gate.py `items_to_decide`) — a plan for the
next run, read off a run's per-item scores.

    python scripts/items_needed.py results/routed3-h200-2026-12-04/qwen25coder_0p5b_to_1p5b_routed_fewshot_*
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from src.gate import items_to_decide, thresholds  # noqa: E402
from src.routed import loss_spread  # noqa: E402
from src.routed_runs import task_scores  # noqa: E402
from src.tasks import METRICS  # noqa: E402
from src.tracking import RecordError, read_items  # noqa: E402


def plan(loss: float, sd: float, margin: float) -> str:
    """'≈ N items would show PASS|FAIL' at this loss, or why no number of items decides it."""
    needed = items_to_decide(loss, sd, margin)
    if needed is None:
        return "no item count decides it (the loss sits on the margin, or one item gives no spread)"
    return f"≈ {needed} items would show {'PASS' if loss < margin else 'FAIL'} at this loss"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (record.json + artifacts/routed/items.json)")
    parser.add_argument("--margin", type=float, help="non-inferiority margin in points (default: the gate's)")
    args = parser.parse_args()
    margin = thresholds(max_loss_points=args.margin).max_loss_points
    for run in args.runs:
        try:
            items = read_items(run)
        except RecordError as error:
            sys.exit(f"items_needed: {error}")
        spread = loss_spread(items)
        for task in sorted({item["task"] for item in items}):
            rows = [item for item in items if item["task"] == task]
            routed, native = (task_scores(rows, mode).correct(METRICS[task][0]) for mode in ("routed", "native_target"))
            loss = 100 * float(np.mean(native.astype(np.float64) - routed.astype(np.float64)))
            print(
                f"{run.name} {task}: {len(rows)} items, {np.mean(routed != native):.1%} flip, loss {loss:+.2f} pt "
                f"vs margin {margin:g}: {plan(loss, spread[f'task.{task}.loss_points_sd'], margin)}"
            )


if __name__ == "__main__":
    main()
