"""How many items per task a routed run's quality CI needs: the share of items whose routed and all-native answers
differ (a paired difference's variance comes only from them), and the items that bring the 95 % CI half-width to the
gate's bound (conf/gate/default.yaml max_ci_half_width) — a plan for the next run, read off a run's per-item scores.

    python scripts/items_needed.py results/routed3-h200-2026-12-04/qwen25coder_0p5b_to_1p5b_routed_fewshot_*
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from src.gate import DEFAULTS, items_for  # noqa: E402
from src.routed import loss_spread  # noqa: E402
from src.routed_runs import task_scores  # noqa: E402
from src.tasks import METRICS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (record.json + artifacts/routed/items.json)")
    parser.add_argument("--half-width", type=float, help="CI half-width in points (default: the gate's)")
    args = parser.parse_args()
    half_width = args.half_width or DEFAULTS.max_ci_half_width
    for run in args.runs:
        items = json.loads((run / "artifacts/routed/items.json").read_text())["items"]
        spread = loss_spread(items)
        for task in sorted({item["task"] for item in items}):
            rows = [item for item in items if item["task"] == task]
            routed, native = (task_scores(rows, mode).correct(METRICS[task][0]) for mode in ("routed", "native_target"))
            print(
                f"{run.name} {task}: {len(rows)} items, {np.mean(routed != native):.1%} flip, "
                f"≈ {items_for(spread[f'task.{task}.loss_points_sd'], half_width)} items for a ±{half_width:g} pt CI"
            )


if __name__ == "__main__":
    main()
