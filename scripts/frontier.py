"""Quality against prefill spent for the routed lever runs of a record folder: one panel per direction and item
split, one series per recompute rule (pure transfer and other levers as single points), the mean loss in points
against the all-native session with its paired 95 % CI as error bars.

    python scripts/frontier.py results/routed-h200-2026-12-03 results/routed2-h200-2026-12-03 --out docs/frontier.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's src/, from anywhere
from src.report.rows import metric, record_rows  # noqa: E402


def series(
    rows: list[dict], workload: str
) -> dict[tuple[str, str], dict[str, list[tuple[float, float, float, float]]]]:
    """(direction, split) → label → [(prefill, loss, low, high)] sorted by prefill, for the routed runs of `workload`."""
    found: dict = {}
    for row in rows:
        if row.get("tags.job") != "routed" or row.get("tags.workload") != workload:
            continue
        panel = (str(row.get("tags.direction")), str(row.get("tags.split", "test")))
        recompute = float(row.get("params.policy.levers.recompute") or 0)
        label = f"recompute, {row.get('params.policy.levers.recompute_rule')} rule" if recompute else "no recompute"
        point = tuple(
            metric(row, n) for n in ("prefill_fraction", *(f"task.mean.loss_points{s}" for s in ("", "_low", "_high")))
        )
        found.setdefault(panel, {}).setdefault(label, []).append(point)
    return {panel: {label: sorted(points) for label, points in labels.items()} for panel, labels in found.items()}


def plot(panels: dict, title: str) -> plt.Figure:
    labels = sorted({label for series in panels.values() for label in series})
    colors = {label: f"C{i}" for i, label in enumerate(labels)}  # one colour per series across panels
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for axis, ((direction, split), found) in zip(axes[0], sorted(panels.items()), strict=True):
        for label, points in sorted(found.items()):
            x, y, low, high = zip(*points, strict=True)
            errors = [[v - lo for v, lo in zip(y, low, strict=True)], [hi - v for v, hi in zip(y, high, strict=True)]]
            axis.errorbar([100 * v for v in x], y, yerr=errors, marker="o", capsize=3, label=label, color=colors[label])
        axis.axhline(1.0, color="grey", linestyle=":", label="gate: 1 point")
        axis.set(title=f"{direction.replace('qwen25coder_', '')}, {split} items", xlabel="prefill spent (%)")
        axis.set_ylabel("mean loss vs all-native (points, 95 % CI)")
        axis.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workload", default="passage")
    args = parser.parse_args()
    rows = [row for folder in args.records for row in record_rows(folder)]
    panels = series(rows, args.workload)
    if not panels:
        sys.exit(f"frontier: no finished routed {args.workload} runs under {[str(f) for f in args.records]}")
    plot(panels, f"routed {args.workload}: quality vs prefill spent").savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({sum(len(v) for p in panels.values() for v in p.values())} runs)")


if __name__ == "__main__":
    main()
