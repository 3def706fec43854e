"""How a routed run's clock behaved, read off its record: per task the history lengths, median TTFT per path (routed,
re-prefill, hit), the median paired speedup and the answers' NLL; the first scored turns one by one; the median per
path in consecutive blocks of turns, in the order they ran; the same-work check (src/routed.py `same_work`:
the baseline's re-prefill / the same re-prefill timed in the routed session); the `auto` policy's estimates (from the handoff
reasons); and the run's wall time per scored turn against what its `throughput.*` metrics count. A drift that moves
every path, or a baseline slower than the same work inside the routed session, is the harness, not the transfer.

    python scripts/ttft_drift.py results/routed4-h200-2026-12-04/*fewshot* [--blocks 8] [--first 2]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from src.eval.intervals import median_interval
from src.routed import timing  # noqa: E402
from src.tracking import ITEMS, RecordError, read_items, read_record, require  # noqa: E402

PATHS = ("routed", "reprefill", "hit")
ESTIMATE = re.compile(r"auto: (?:re-prefill|map) ≈ ([\d.]+) ms [≤<] (?:map|re-prefill) ≈ ([\d.]+) ms")


def _p50(turns: list[dict]) -> str:
    return " / ".join(f"{statistics.median(turn['ttft'][path] for turn in turns):6.1f}" for path in PATHS)


def per_task(items: list[dict]) -> list[str]:
    """One line per task: turns, history tokens (median, max), TTFT p50 per path, paired speedup, NLL routed / native."""
    lines = []
    for task in sorted({item["task"] for item in items}):
        rows = [item for item in items if item["task"] == task and item["ttft"]]
        history = [row["history_tokens"] for row in rows]
        speedup = statistics.median(row["ttft"]["reprefill"] / row["ttft"]["routed"] for row in rows)
        nll = [statistics.fmean(row["nll"][mode] for row in rows) for mode in ("routed", "native_target")]
        lines.append(
            f"  {task}: {len(rows)} turns, history median {statistics.median(history):,.0f} max {max(history):,} tokens; "
            f"p50 {_p50(rows)} ms; speedup {speedup:.2f}×; NLL routed {nll[0]:.3f} / native {nll[1]:.3f}"
        )
    return lines


def drift(items: list[dict], blocks: int) -> list[str]:
    """One line per block: its turns, median TTFT per path (ms), and how its handoffs went."""
    size = max(1, -(-len(items) // blocks))
    lines = []
    for start in range(0, len(items), size):
        chunk = [item for item in items[start : start + size] if item["ttft"]]
        paths = {p: sum((item.get("handoff") or {}).get("path") == p for item in chunk) for p in ("map", "reprefill")}
        lines.append(
            f"  turns {start:4d}–{start + len(chunk) - 1:<4d} {_p50(chunk)}   map {paths['map']}, re-prefill {paths['reprefill']}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="record folders (results/<run-set>/<run>)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--first", type=int, default=2, help="scored turns printed one by one")
    args = parser.parse_args()
    try:
        for run in args.runs:
            report(run, args.blocks, args.first)
    except RecordError as error:
        sys.exit(f"ttft_drift: {error}")


def report(run: Path, blocks: int, first: int) -> None:
    """Print one run's lines (module docstring); a record without what they need is a RecordError naming it."""
    items = read_items(run)
    path = run / "record.json"
    record = read_record(path)
    params = record["params"]
    n_boot, seed = int(require(params, "eval.tasks.n_boot", path)), int(require(params, "seed", path))
    print(f"{run.name}: {len(items)} turns; TTFT ms routed / re-prefill / hit")
    print("\n".join(per_task(items)))
    for n, item in enumerate(items[:first]):
        print(f"  turn {n} ({item['history_tokens']:,} tokens): {_p50([item])}")
    print("\n".join(drift(items, blocks)))
    found = timing(items, n_boot, seed)
    same = found.get("ttft.same_work_ratio")
    checked = f"{same:.2f}× on {found['ttft.same_work_items']:.0f} turns" if same else "—"
    inside = [i["ttft"]["same_work"] / i["ttft"]["routed"] for i in items if "same_work" in (i["ttft"] or {})]
    if len(inside) >= 2:  # the speedup on the routed session's own clock: its same-work re-prefill / its routed turn
        middle, low, high = median_interval(inside)
        checked += f"; on the routed session's clock (same work / routed) {middle:.2f}× [{low:.2f}, {high:.2f}]"
    print(
        f"  speedup (median paired) {require(found, 'ttft_speedup', run / ITEMS):.2f}× "
        f"[{found['ttft_speedup_low']:.2f}, {found['ttft_speedup_high']:.2f}]; "
        f"same work (baseline re-prefill / the same re-prefill in the routed session) {checked}"
    )
    estimates = [ESTIMATE.search((item.get("handoff") or {}).get("reason", "")) for item in items]
    chosen = {"map": [], "re-prefill": []}
    for match, item in zip(estimates, items, strict=True):
        if match:  # "auto: A ≈ x ms ≤|< B ≈ y ms": x is the chosen path's estimate, y the other's
            prefill_first = item["handoff"]["path"] == "reprefill"
            chosen["re-prefill"].append(float(match[1] if prefill_first else match[2]))
            chosen["map"].append(float(match[2] if prefill_first else match[1]))
    if chosen["map"]:
        print("  auto estimates: " + "; ".join(f"{path} {min(v):,.0f}–{max(v):,.0f} ms" for path, v in chosen.items()))
    seconds = (require(record, "end_time", path) - require(record, "start_time", path)) / 1e3
    metrics = {m["key"]: m["value"] for m in record["metrics"]}
    counted = sum(1 / require(metrics, f"throughput.{kind}_items_per_s", path) for kind in ("routed", "reprefill"))
    print(
        f"  run wall time {seconds:.0f} s, {seconds / len(items):.2f} s per scored turn (loads, fit, replay "
        f"included): {seconds / len(items) / counted:.2f}× the {counted:.2f} s that throughput.* counts"
    )


if __name__ == "__main__":
    main()
