"""How a routed run's clock behaved, read off its record: per task the history lengths, median TTFT per path (routed,
re-prefill, hit), the median paired speedup and the answers' NLL; the first scored turns one by one; the median per
path in consecutive blocks of turns, in the order they ran; the same-work check (src/routed.py `same_work`:
the baseline's re-prefill / the same re-prefill timed in the routed session); the `auto` policy's estimates (from the handoff
reasons); and the run's wall time per scored turn against what its `throughput.*` metrics count. A drift that moves
every path, or a baseline slower than the same work inside the routed session, is the harness, not the transfer.

First uses (`first_uses`): a cost paid once per shape inside a clock shows as turns slower on a shape their process
had not run before. Single-turn rows split the re-prefill by whether its length (history + turn) is new to the
shard's process (the warm-up items, the first `workload.warmup` of each shard, ran their shapes once untimed), and on
a graph engine the routed and hit paths by whether the turn's CUDA-graph bucket is (captured on first use).

    python scripts/ttft_drift.py results/routed4-h200-2026-12-04/*fewshot* [--blocks 8] [--first 2]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from src.eval.intervals import median_interval
from src.records import RecordError, items_path, read_items, read_record, require  # noqa: E402
from src.routed import timing  # noqa: E402
from src.runtime.forward_graph import GRAPH_BUCKETS  # noqa: E402

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


def processes(items: list[dict], params: dict) -> list[int]:
    """Per row, the shard whose process ran it: in a joined record (`workload.shard` "all") the row at position p of
    its task came from shard p mod `workload.shards` (src/routed_merge.py `interleave`); else one process ran all."""
    if params.get("workload.shard") != "all":
        return [0] * len(items)
    shards, position = int(params["workload.shards"]), {}
    found = []
    for row in items:
        position[row["task"]] = position.get(row["task"], -1) + 1
        found.append(position[row["task"]] % shards)
    return found


def first_uses(items: list[dict], process: list[int], warmup: int, key: Callable[[dict], object]) -> list[bool]:
    """Per row, whether key(row) is new to its process (its rows in the order they ran; the first `warmup` of each
    ran once, untimed, before any was scored: their keys are seen)."""
    seen = {}
    for n in set(process):
        mine = [row for row, p in zip(items, process, strict=True) if p == n]
        seen[n] = {key(row) for row in mine[:warmup]}
    new = []
    for row, n in zip(items, process, strict=True):
        new.append(key(row) not in seen[n])
        seen[n].add(key(row))
    return new


def _split(items: list[dict], new: list[bool], paths: tuple[str, ...]) -> str:
    """p50 per path (ms) and the turn count, on the rows flagged new and on the others."""
    parts = []
    for flag, label in ((True, "new"), (False, "seen before")):
        rows = [item for item, n in zip(items, new, strict=True) if n is flag and all(p in item["ttft"] for p in paths)]
        p50 = " / ".join(f"{statistics.median(r['ttft'][p] for r in rows):.1f}" for p in paths) if rows else "—"
        parts.append(f"{label} {p50} ms ({len(rows)} turns)")
    return "; ".join(parts)


def first_use_lines(items: list[dict], params: dict) -> list[str]:
    """The first-use splits (module docstring) of single-turn rows; none for switches and conversations, whose
    re-prefill length is not history + turn."""
    rows = [item for item in items if item["ttft"] and "switches" not in item and "conversation" not in item]
    if not rows:
        return []
    process, warmup = processes(rows, params), int(params.get("workload.warmup") or 0)
    length = first_uses(rows, process, warmup, lambda row: row["history_tokens"] + row["turn_tokens"])
    lines = [f"  re-prefill on a length new to its process / seen before: {_split(rows, length, ('reprefill',))}"]
    if params.get("workload.engine_capacity") not in (None, "None"):
        bucket = lambda row: next((b for b in GRAPH_BUCKETS if b >= row["turn_tokens"]), "eager")
        graphs = first_uses(rows, process, warmup, bucket)
        lines.append(f"  routed / hit on a turn whose graph bucket is new / seen before: "
                     f"{_split(rows, graphs, ('routed', 'hit'))}")  # fmt: skip
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
    print("\n".join(drift(items, blocks) + first_use_lines(items, params)))
    found = timing(items, n_boot, seed)
    same = found.get("ttft.same_work_ratio")
    checked = f"{same:.2f}× on {found['ttft.same_work_items']:.0f} turns" if same else "—"
    inside = [i["ttft"]["same_work"] / i["ttft"]["routed"] for i in items if "same_work" in (i["ttft"] or {})]
    if len(inside) >= 2:  # the speedup on the routed session's own clock: its same-work re-prefill / its routed turn
        middle, low, high = median_interval(inside)
        checked += f"; on the routed session's clock (same work / routed) {middle:.2f}× [{low:.2f}, {high:.2f}]"
    print(
        f"  speedup (median paired) {require(found, 'ttft_speedup', items_path(run)):.2f}× "
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
