"""The vLLM TTFT table (scripts/bench_vllm_ttft.py records): per history length, each path's median time to first
token inside vLLM and its speedup over vLLM's re-prefill, paired per repeat, with the median's 95 % interval."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from src.eval.intervals import median_interval
from src.report.rows import fmt
from src.serving.timings import PHASES

TIMED = {role: [p for p in phases if p != "export"] for role, phases in PHASES.items()}  # a handoff's own phases

Document = tuple[str, dict]  # (path under results/, the parsed JSON)


@dataclass(frozen=True)
class BenchRun:
    """What a bench record does not hold about its run: the connector's transport, the dtype, the code commit."""

    transport: str
    dtype: str
    commit: str


def speedup(interval: Sequence[float | None]) -> str:
    """'0.26× [0.23, 0.28]' from [median, low, high]; a bound None or infinite (fewer than 6 repeats): no interval."""
    middle, low, high = (math.nan if x is None else x for x in interval)
    bounds = f" [{fmt(low, 2)}, {fmt(high, 2)}]" if math.isfinite(low) and math.isfinite(high) else ""
    return f"{fmt(middle, 2)}×{bounds}"


def mapper_of(bench: dict) -> str:
    """The mapper a bench record timed: its own words since 2026-12-07; before, the bench's random mapper was always
    Head-Local k = 2 in float32 (scripts/bench_vllm_ttft.py), a real one the fit's (its dtype where recorded)."""
    run = bench.get("run", {})
    if "mapper" in run:
        return f"{run['mapper']}, {run.get('compute_dtype', 'float32')} coefficients"
    if bench["weights"] == "random":
        return "random Head-Local k = 2, float32 coefficients"
    return f"the fitted mapper, {run.get('compute_dtype', 'float32')} coefficients"


def vllm_ttft(rows: list, *documents: Document, runs: dict[str, BenchRun]) -> str:
    """One block per bench record: re-prefill, prefix hit, the receiver's mapped request ("map"), the sender's export
    (its request with the export minus one without) and routed (map + export) TTFT medians (ms), then re-prefill /
    routed, re-prefill / map, re-prefill / hit and routed / hit, each the median of the per-repeat ratios [95 %
    interval], paired by repeat as the bench pairs its speedups."""
    lines = []
    for where, bench in documents:
        run, machine = runs[where], bench["machine"]
        repeats = {len(row["map_ms"]) for row in bench["rows"]}
        pair = " → ".join(Path(part).stem for part in bench["pair"].split(" → "))  # a config, or two model folders
        lines += [
            f"{pair}, {bench['weights']} weights, {run.dtype}, mapper: {mapper_of(bench)}, "
            f"new turn {bench['turn']} tokens, "
            f"{'/'.join(map(str, sorted(repeats)))} repeats, transport: {run.transport} — {machine['date']}, "
            f"code {run.commit}, vllm {machine['vllm']}, torch {machine['torch']}, {machine['device']} "
            f"(`results/{where}`)",
            "",
            "| history | re-prefill / hit / map / export / routed (ms, p50) | routed speedup [95 % CI] "
            "| map alone: speedup [95 % CI] | hit speedup [95 % CI] | routed / hit [95 % CI] |",
            "|---|---|---|---|---|---|",
        ]
        for row in bench["rows"]:
            median = row["median_ms"]
            ms = [
                median["reprefill"],
                median["hit"],
                median["map"],
                statistics.median(row["export_ms"]),
                median["routed"],
            ]
            mapped = median_interval([r / m for r, m in zip(row["reprefill_ms"], row["map_ms"], strict=True)])
            routed = [m + max(e, 0.0) for m, e in zip(row["map_ms"], row["export_ms"], strict=True)]  # as the bench
            over_hit = median_interval([r / h for r, h in zip(routed, row["hit_ms"], strict=True)])
            lines.append(
                f"| {row['tokens']:,} | {' / '.join(fmt(x, 1) for x in ms)} | {speedup(row['speedup']['routed'])} "
                f"| {speedup(mapped)} "
                f"| {speedup(row['speedup']['hit'])} | {speedup(over_hit)} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def vllm_phases(rows: list, *documents: Document) -> str:
    """Where a handoff's host time goes (`--timings` records, src/serving/timings.py): per history length, the
    median host ms of each phase over the measured repeats (—: the phase never ran, e.g. `write` under the direct
    writer), the receiver's phases summed beside its mapped request's excess over the hit (map − hit, medians). The
    worker's export includes its wait for the sender's own forward. The last column is the map's device time (CUDA
    events around it, timings.py; — before 2026-12-07's records or off CUDA): a check longer than it is a late map."""
    lines = []
    for where, bench in documents:
        scheduler, worker = TIMED["scheduler"], TIMED["worker"]
        lines += [
            f"`results/{where}` ({bench['weights']} weights) — host ms, median per phase",
            "",
            "| history | " + " | ".join(f"sched. {p}" for p in scheduler) + " | "
            + " | ".join(f"worker {p}" for p in worker)
            + " | receiver sum | map − hit (TTFT p50s) | worker export | map on the device |",
            "|---|" + "---|" * (len(scheduler) + len(worker) + 4),
        ]  # fmt: skip
        for row in bench["rows"]:
            host, median = row["host_ms"], row["median_ms"]
            cells = [host["scheduler"].get(p, math.nan) for p in scheduler] + [
                host["worker"].get(p, math.nan) for p in worker
            ]
            excess, ran = median["map"] - median["hit"], sum(x for x in cells if not math.isnan(x))  # phases that ran
            lines.append(
                f"| {row['tokens']:,} | " + " | ".join(fmt(x, 2) for x in cells)
                + f" | {fmt(ran, 2)} | {fmt(excess, 1)} | {fmt(host['worker'].get('export', math.nan), 1)} "
                f"| {fmt(host.get('device', {}).get('map', math.nan), 2)} |"
            )  # fmt: skip
        lines.append("")
    return "\n".join(lines).rstrip()


def vllm_brief(document: Document, run: BenchRun) -> tuple[str, str]:
    """README's headline cells for a bench record: (the routed speedup at the shortest and longest history, with the
    longest's medians; what it was measured on)."""
    where, bench = document
    first, last = bench["rows"][0], bench["rows"][-1]
    median = last["median_ms"]
    highs = [row["speedup"]["routed"][2] for row in bench["rows"]]
    slower = all(high is not None and high < 1 for high in highs)
    export = statistics.median(last["export_ms"])  # the sender's request with the export minus without
    cost = f"{fmt(export)} ms" if export > 0 else f"within its request's noise (median {fmt(export)} ms)"
    answer = (
        ("slower than re-prefill at every length (each 95 % CI below 1): " if slower else "")
        + f"{speedup(first['speedup']['routed'])} at {first['tokens']:,} to {speedup(last['speedup']['routed'])} at "
        f"{last['tokens']:,} tokens; p50 {fmt(median['routed'])} vs {fmt(median['reprefill'])} ms at "
        f"{last['tokens']:,} — the sender's export alone {cost} ({run.transport.split(',')[0]} transport)"
    )
    machine = bench["machine"]
    weights = "the real pair and its mapper" if bench["weights"] == "real" else "random weights of the pair's shapes"
    on = (
        f"{weights}, {run.dtype}, vllm {machine['vllm']}, "
        f"{machine['device'].removeprefix('NVIDIA ')}, {machine['date']}"
    )
    return answer, on
