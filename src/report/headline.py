"""README.md's front-door tables, rebuilt from the same committed records as BENCHMARKS.md's tables:

`headline`        one short row per question a reader brings — should I promote it, what does a handoff lose (per
                  workload and direction), how fast is it (per engine and history length), what does each lever buy,
                  how long does a fit take, how big is a map, does rollback hold — each number with its CI where the
                  record has one, what it was measured on, and the BENCHMARKS.md section with the full tables;
`decision_brief`  the gate's decision (`python -m src.gate --summary`, BENCHMARKS table `decision`) with one short
                  cell per criterion.

A row names its run by the label the routed tables print (`routed_label`); the latest run with that label is read, as
the gate reads the latest run of a group. A label that matches no record is an error, never an empty cell.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import UTC, datetime

from src.gate_criteria import mean_loss, median_of, run_status, task_verdicts, thresholds
from src.report.routed_tables import decided, gain, routed_label, run_of, verdicts
from src.report.rows import NO_INTERVAL, Row, at_step, fmt, has_intervals, joined, metric, ratio_at_step
from src.report.vllm_table import BenchRun, vllm_brief
from src.routed import same_work_ratios, speedup_ratios

BENCH = "BENCHMARKS.md"
Document = tuple[str, dict]  # (path under results/, the parsed JSON)


def _pick(rows: list[Row], label: str, engine: str | None = None) -> Row:
    """The latest routed run whose routed-table label is `label`, on the receiver `engine` (tag `engine`; None: Hugging
    Face eager)."""
    found = [
        row
        for row in rows
        if row.get("tags.job") == "routed" and routed_label(row) == label and row.get("tags.engine") == engine
    ]
    if not found:
        raise ValueError(f"headline: no routed record labelled {label!r}" + (f" on engine {engine}" if engine else ""))
    return found[-1]  # rows come oldest first


def _day(row: Row) -> str:
    return datetime.fromtimestamp(row["start_time"] / 1000, tz=UTC).strftime("%Y-%m-%d")


def _gpu(name: object) -> str:
    return str(name).removeprefix("NVIDIA ")


def _dtype(row: Row) -> str:
    dtype = str(row.get("params.pair.dtype"))
    return {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)


def _on(row: Row) -> str:
    """Scored turns, weights, dtype, machine and date of a routed run."""
    turns = sum(
        v for k, v in row.items() if k.startswith("metrics.task.") and k.endswith(".items") and ".mean." not in k
    )
    return (
        f"{turns:.0f} turns, {row.get('tags.weights')} weights, {_dtype(row)}, {_gpu(row.get('tags.gpu'))}, {_day(row)}"
    )


def _span(runs: list[Row]) -> str:
    """How many runs, their weights, machines and dates."""
    weights = "/".join(sorted({str(row.get("tags.weights")) for row in runs}))
    gpus = "/".join(sorted({_gpu(row.get("tags.gpu")) for row in runs}))
    days = sorted({_day(row) for row in runs})
    return f"{len(runs)} routed runs, {weights} weights, {gpus}, {days[0]} – {days[-1]}"


def _status(row: Row, criterion: str) -> str:
    """The gate's status of one criterion on this run alone (src/gate_criteria.py judge_run)."""
    (verdict,) = [v for v in verdicts(row) if v.criterion.startswith(criterion)]
    return verdict.status


def _loss(row: Row, status: bool = True) -> str:
    """Mean loss over tasks in points with the gate's interval (each task's Tango interval, joined by MOVER), and the
    gate's quality status on this run."""
    loss, low, high = mean_loss(task_verdicts(run_of(row), thresholds()))
    return f"{fmt(loss)} [{fmt(low, 0)}, {fmt(high, 0)}] pt" + (f", {_status(row, 'quality')}" if status else "")


def _median(row: Row, ratios) -> str:
    """'m× [low, high] on N units' of a median the gate judges (src/gate_criteria.py median_of)."""
    m = median_of(run_of(row), ratios, "none timed")
    return f"{fmt(m.value, 2)}× [{fmt(m.low, 2)}, {fmt(m.high, 2)}] on {m.units} {m.noun}"


def _speedup(row: Row) -> str:
    """Median paired TTFT speedup [the gate's 95 % interval] and the p50s it compares."""
    return (
        f"{_median(row, speedup_ratios)}, {_status(row, 'latency:')}; "
        f"p50 {fmt(metric(row, 'ttft.routed_ms_p50'))} vs {fmt(metric(row, 'ttft.reprefill_ms_p50'))} ms"
    )


def _sci(value: float) -> str:
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _link(anchor: str, text: str) -> str:
    return f"[{text}]({BENCH}#{anchor})"


UP, DOWN = "0.5b → 1.5b", "1.5b → 0.5b"


def headline(rows: list[Row], fused: Document, vllm: Document, *, vllm_run: BenchRun) -> str:
    """One row per question; `rows`: the routed and engine record sets, `fused`: the Fused-Fit bench record, `vllm`:
    the vLLM TTFT bench record and what it does not hold (`vllm_run`)."""
    rows = joined(rows)  # a shard is read only in its join
    lines = ["| question | answer | measured on | more |", "|---|---|---|---|"]
    add = lambda question, answer, on, more: lines.append(f"| {question} | {answer} | {on} | {more} |")

    points = decided(rows)
    planned = sum(1 for d in points if d.chosen.plan is not None)
    criteria = Counter(run_status([v.status for v in d.verdicts]) for d in points)
    add(
        "**Promote the mapping layer?** (the gate)",
        f"**{'yes' if all(d.passed for d in points) else 'no'}**: {sum(d.passed for d in points)} of {len(points)} "
        f"workload × direction × operating points pass — {planned} pre-registered"
        + (" (the runs so far predate plans)" if all("predates plans" in d.outcome for d in points) else "")
        + f"; on their criteria {criteria['FAIL'] + criteria['MISSING']} fail, {criteria['UNDERPOWERED']} are "
        "undecided (UNDERPOWERED)",
        _span([row for row in rows if row.get("tags.job") == "routed"]),
        _link("the-decision", "the decision"),
    )

    # Quality: accuracy points lost against the all-re-prefill session (native), paired 95 % CI; < 0: routed better.
    quality = [
        ("few-shot history mapped, ≤ 2K tokens", f"fewshot | {UP} | pure transfer"),
        ("few-shot history mapped, 200 shots (≤ 8,192 tokens)", f"fewshot (200 shots, bf16) | {UP} | pure transfer"),
        ("multi-turn chat, every 2nd turn escalated", f"multiturn | {UP} | pure transfer"),
        ("after 8 model switches (last chunk mapped)", f"switches | {UP} | pure transfer"),
    ]
    for question, label in quality:
        row = _pick(rows, label)
        add(
            f"Quality loss, {question}, 0.5B → 1.5B",
            _loss(row),
            _on(row),
            _link("quality", "quality"),
        )
    served = _pick(rows, f"fewshot (200 shots, bf16) | {UP} | pure transfer", engine="graph")
    add(
        "Quality loss, few-shot history mapped, 200 shots, on the graph engine, 0.5B → 1.5B",
        _loss(served),
        _on(served),
        _link("on-the-graph-engine-with-real-weights-the-gates-workload", "latency on the graph engine"),
    )
    for arrow, name in ((UP, "0.5B → 1.5B"), (DOWN, "1.5B → 0.5B")):
        pure = _pick(rows, f"passage | {arrow} | pure transfer")
        lever = _pick(rows, f"passage | {arrow} | native_sink=4, recompute=0.4, rule=deviation")
        add(
            f"Quality loss, mapped passage read back, {name}",
            f"{_loss(pure)}; recomputing 40 % of it: {_loss(lever, status=False)}",
            _on(pure),
            _link("quality", "quality"),
        )

    # Latency: end-to-end TTFT of the target after the switch, re-prefill / routed, median of the paired ratios.
    latency = [
        ("≤ 512 tokens (passage)", f"passage | {UP} | pure transfer"),
        ("≤ 2K tokens (few-shot)", f"fewshot | {UP} | pure transfer"),
        ("≤ 8,192 tokens (200-shot few-shot)", f"fewshot (200 shots, bf16) | {UP} | pure transfer"),
    ]
    for question, label in latency:
        row = _pick(rows, label)
        add(
            f"Handoff speedup vs re-prefill, HF eager receiver, {question}",
            _speedup(row),
            _on(row),
            _link("per-length-routed-handoffs-on-the-real-pair", "latency per length"),
        )
    add(
        "Handoff speedup vs re-prefill, graph engine (static cache, CUDA graphs), ≤ 8,192 tokens (200-shot few-shot)",
        f"{_speedup(served)}; timing harness: {_median(served, same_work_ratios)} "
        f"({_status(served, 'latency harness')})",
        _on(served),
        _link("on-the-graph-engine-with-real-weights-the-gates-workload", "latency on the graph engine"),
    )
    (engine,) = [row for row in rows if row.get("params.job") == "handoff"]
    steps = sorted(engine["series.speedup.graph.map"])
    hits = [at_step(engine, "ttft.graph.hit_ms_p50", step) for step in steps]
    add(
        "Handoff speedup vs re-prefill, serving-grade receiver (static cache, CUDA graphs)",
        ", ".join(f"{ratio_at_step(engine, 'speedup.graph.map', s)} at {s // 1024}K" for s in steps[-2:])
        + ", ratios of medians"
        + (" [95 % interval]" if has_intervals(engine, "speedup.graph.map") else f" {NO_INTERVAL}")
        + f"; a new turn {fmt(min(hits))}–{fmt(max(hits))} ms at {steps[0] // 1024}K–"
        f"{steps[-1] // 1024}K",
        f"{engine.get('tags.weights')} weights of the pair's shapes, {_dtype(engine)}, "
        f"{_gpu(engine.get('tags.gpu'))}, {_day(engine)}",
        _link("per-engine-a-serving-grade-receiver", "latency per engine"),
    )
    add(
        "Handoff speedup vs re-prefill inside vLLM (two engines, the kvrelay connector)",
        *vllm_brief(vllm, vllm_run),
        _link(
            "the-fourteenth-session-lease-the-senders-export-in-one-launch-the-real-pair-inside-vllm-frontier3-step-2-one-"
            "h100-2026-12-07",
            "latency inside vLLM",
        ),
    )

    # Levers: paired on the same test items, routed accuracy with the lever minus without.
    up_pure, down_pure = (
        _pick(rows, f"passage | {UP} | pure transfer"),
        _pick(rows, f"passage | {DOWN} | pure transfer"),
    )
    up_rc = _pick(rows, f"passage | {UP} | native_sink=4, recompute=0.4, rule=deviation")
    down_rc = _pick(rows, f"passage | {DOWN} | native_sink=4, recompute=0.4, rule=deviation")
    add(
        "Lever: recompute 40 % of the mapped passage (deviation rule), gain over pure transfer",
        f"{gain(up_rc, up_pure)} pt up, {gain(down_rc, down_pure)} pt down, at "
        f"{fmt(metric(up_rc, 'prefill_fraction'), 0, 100)} % of the prefill; TTFT "
        f"{fmt(metric(up_rc, 'ttft_speedup'), 2)}× / {fmt(metric(down_rc, 'ttft_speedup'), 2)}× re-prefill",
        _on(up_rc),
        _link("recompute-on-routed-passages", "levers"),
    )
    up_v = _pick(rows, f"passage | {UP} | V fit in attention space")
    down_v = _pick(rows, f"passage | {DOWN} | V fit in attention space")
    add(
        "Lever: V fitted in attention-output space, gain over the token-space fit (passage)",
        f"{gain(up_v, up_pure)} pt up, {gain(down_v, down_pure)} pt down, at "
        f"{fmt(metric(up_v, 'prefill_fraction'), 0, 100)} % of the prefill",
        _on(up_v),
        _link("v-fitted-where-it-is-read-calibration-the-target-wrote", "levers"),
    )
    greedy = _pick(rows, f"passage | {UP} | calibration 50% target-greedy")
    add(
        "Lever: calibration half written by the target (greedy), gain over pure transfer (passage)",
        f"{gain(greedy, up_pure)} pt up",
        _on(greedy),
        _link("v-fitted-where-it-is-read-calibration-the-target-wrote", "levers"),
    )

    # Construction and storage: the Fused-Fit bench record (random data at the 14B → 32B shapes: timing only).
    where, bench = fused
    shape, paths, env = bench["shape"], bench["paths"], bench["environment"]
    day = re.search(r"\d{4}-\d{2}-\d{2}", where).group(0)
    worst = max(paths["fused"]["max_relative_difference_vs_generic"].values())
    on = (
        f"random data, {shape['source_layers']} → {shape['target_layers']} layers (Qwen3 14B → 32B shapes), "
        f"{_gpu(env['device'])}, {day}"
    )
    add(
        f"Construction: fit a Head-Local k = {shape['k']} map, {shape['rows']:,} rows (Fused-Fit)",
        f"{fmt(paths['fused']['median_seconds'], 2)} s, within {_sci(worst)} of the fp64 path "
        f"({fmt(paths['generic']['median_seconds'], 2)} s); goal ≤ {bench['goal']['seconds']:g} s "
        f"{'met' if bench['goal']['seconds_met'] else 'not met'}",
        on,
        _link("construction", "construction"),
    )
    per_map = shape["target_layers"] * 2 * shape["heads"] * (shape["p"] * shape["dim"] + shape["dim"])  # W + b
    size = paths["fit"]["coefficient_bytes"]
    add(
        f"Storage: one Head-Local k = {shape['k']} map",
        f"{size / 1e9:.3f} GB ({size:,} B: {per_map:,} coefficients × {size // per_map} B)",
        on,
        _link("storage", "storage"),
    )

    # Reliability: rollback replayed on each run's items; the timing harness on the runs that sampled it.
    routed = [row for row in rows if row.get("tags.job") == "routed"]
    broken = [row for row in routed if metric(row, "rollback_verified") != 1.0]
    add(
        "Rollback: every refusal falls back to a bit-identical re-prefill",
        f"verified on {len(routed) - len(broken)} of {len(routed)} routed runs; NOT on "
        + "; ".join(f"{routed_label(row).replace(' | ', ', ')} ({_day(row)})" for row in broken),
        _span(routed),
        _link("rollback", "reliability"),
    )
    sampled = [row for row in routed if same_work_ratios(run_of(row).items)]
    add(
        "Timing harness: the same work timed alike in both sessions (gate: 95 % interval within 1.25×)",
        "; ".join(
            f"{routed_label(row).replace(' | ', ', ')}: {_median(row, same_work_ratios)} "
            f"({_status(row, 'latency harness')})"
            for row in sampled
        )
        + f"; not sampled by the other {len(routed) - len(sampled)} runs",
        _span(routed),
        _link("the-timing-harness", "reliability"),
    )
    return "\n".join(lines)


def decision_brief(rows: list[Row]) -> str:
    """The decision as the gate takes it, one short cell per criterion: status, and the speedup or mean loss it read
    (the full cells, each task's loss and the items that would decide it: BENCHMARKS table `decision`)."""
    lines = [
        "| workload | direction | operating point | test items | record = items | latency (speedup [CI]) "
        "| timing harness | quality (mean loss pt [CI]) | rollback | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in decided(rows):
        by_name = {v.criterion.split(":")[0]: v for v in d.verdicts}
        judged = d.chosen.judged
        loss = mean_loss(task_verdicts(judged, thresholds())) if judged.items else (None, None, None)
        speed = by_name["latency"].measured.split(" on ")[0] if by_name["latency"].status != "MISSING" else "—"
        arrow = d.direction.replace("qwen25coder_", "").replace("_to_", " → ")
        cells = [
            by_name["routed workload run"].status,
            by_name["record"].status,
            f"{by_name['latency'].status} {speed}",
            by_name["latency harness"].status,
            f"{by_name['quality'].status} {fmt(loss[0])} [{fmt(loss[1], 0)}, {fmt(loss[2], 0)}]",
            by_name["rollback on this workload"].status,
            d.outcome,
        ]
        lines.append(f"| {d.workload} | {arrow} | {d.point} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
