"""How a routed run's clock behaved over its items: median TTFT per path (routed, re-prefill, hit) in consecutive
blocks of the scored turns, in the order they ran, and the same-work check (src/routed.py `timing`: re-prefill /
routed TTFT where the routed session re-prefilled too). A drift that moves every path, or a baseline slower than
the same work inside the routed session, is the harness, not the transfer.

    python scripts/ttft_drift.py results/routed4-h200-2026-12-04/*fewshot* [--blocks 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from src.routed import timing  # noqa: E402

PATHS = ("routed", "reprefill", "hit")


def drift(items: list[dict], blocks: int) -> list[str]:
    """One line per block: its turns, median TTFT per path (ms), and how its handoffs went."""
    size = max(1, -(-len(items) // blocks))
    lines = []
    for start in range(0, len(items), size):
        chunk = [item for item in items[start : start + size] if item["ttft"]]
        medians = " / ".join(f"{statistics.median(item['ttft'][path] for item in chunk):6.1f}" for path in PATHS)
        paths = {p: sum((item.get("handoff") or {}).get("path") == p for item in chunk) for p in ("map", "reprefill")}
        lines.append(
            f"  turns {start:4d}–{start + len(chunk) - 1:<4d} {medians}   map {paths['map']}, re-prefill {paths['reprefill']}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="record folders (results/<run-set>/<run>)")
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    for run in args.runs:
        items = json.loads((run / "artifacts/routed/items.json").read_text())["items"]
        found = timing(items)
        same = found.get("ttft.same_work_ratio")
        print(f"{run.name}: {len(items)} turns; TTFT p50 ms routed / re-prefill / hit per block")
        print("\n".join(drift(items, args.blocks)))
        print(
            f"  speedup (median paired) {found['ttft_speedup']:.2f}×; same work (re-prefill / routed where both "
            + (f"re-prefilled) {same:.2f}× on {found['ttft.same_work_items']:.0f} turns" if same else "re-prefilled) —")
        )


if __name__ == "__main__":
    main()
