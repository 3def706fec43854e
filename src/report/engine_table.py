"""The handoff-TTFT table (+experiment=handoff, src/eval/ttft.py): per history length and engine."""

from __future__ import annotations

from src.report.rows import NO_INTERVAL, Row, at_step, fmt, has_intervals, provenance, ratio_at_step


def engine(rows: list[Row]) -> str:
    """Handoff TTFT per history length on each engine (+experiment=handoff, src/eval/ttft.py): the map alone, each
    engine's map (routed TTFT) / faster re-prefill / prefix hit (ms, p50), the routed speedup and routed / hit on the
    graph engine, fused recompute's speedups, each ratio of medians with its 95 % interval where the record logged one
    (`ratio_at_step`); one block per record."""
    lines = []
    for row in rows:
        if row.get("params.job") != "handoff":
            continue
        engines = [e for e in ("hf", "static", "graph") if f"series.ttft.{e}.map_ms_p50" in row]
        shares = sorted(
            key.removeprefix("series.speedup.graph.recompute_")
            for key in row
            if key.startswith("series.speedup.graph.recompute_") and not key.endswith(("_lo", "_hi"))
        )
        arrow = str(row.get("tags.direction", "?")).replace("qwen25coder_", "").replace("_to_", " → ")
        intervals = (
            "ratios of medians [95 % interval: src/eval/intervals.py `median_ratio_interval`; —, —: too few repeats]"
            if has_intervals(row, "graph.map_over_hit")
            else f"ratios of medians {NO_INTERVAL}"
        )
        lines += [
            f"{arrow}, {row.get('params.pair.dtype')}, random weights, new turn {row.get('params.eval.handoff.new_turn')}"
            f" tokens — {provenance(row)}; {intervals}",
            "",
            "| history | map alone | "
            + " | ".join(f"{e}: map / re-prefill / hit (ms)" for e in engines)
            + " | graph: speedup, routed / hit | "
            + " | ".join(_recompute_header(r) for r in shares)
            + " |",
            "|" + "---|" * (3 + len(engines) + len(shares)),
        ]
        for step in sorted(row["series.map_ms_p50"]):
            cells = [f"{step:,}", fmt(at_step(row, "map_ms_p50", step), 2)]
            for e in engines:
                base = "reprefill_best" if f"series.ttft.{e}.reprefill_best_ms_p50" in row else "reprefill"
                cells.append(
                    " / ".join(fmt(at_step(row, f"ttft.{e}.{p}_ms_p50", step), 1) for p in ("map", base, "hit"))
                )
            ratios = ("speedup.graph.map", "graph.map_over_hit")
            cells.append(", ".join(ratio_at_step(row, name, step) for name in ratios))
            cells += [ratio_at_step(row, f"speedup.graph.recompute_{r}", step) for r in shares]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def _recompute_header(label: str) -> str:
    """'recompute 25%' for the path recompute_0.25, 'recompute 25% turn p0.5' for recompute_0.25_turn_p0.5
    (src/eval/ttft.py `recompute_path`)."""
    share, *rest = label.split("_")
    return " ".join([f"recompute {float(share):.0%}", *rest])
