"""The fit_eval / probe tables: the quickstart record, horizon NLL, per-task accuracy, probe R², and a rank
correlation of two metrics over runs.

Quality tables, per fit_eval run with tasks (one row): method, levers, prefill fraction, NLL gap recovered,
held-out / task-prompt R², and per task the headline accuracy with the loss in points against the native target
and its paired 95% CI; then the task means. Runs without tasks get the horizon-NLL table; probe runs
(+experiment=feature_probe) the fit / held-out R² per feature variant.
"""

from __future__ import annotations

import math

from src.eval.metrics import rank_correlation
from src.report.rows import Row, fmt, metric, provenance, slashed

VARIANTS = ("own", "kv", "token", "relu")  # src/probe.py, in that order
TASKS = ("hellaswag", "arc_easy", "arc_challenge", "winogrande", "piqa", "mmlu", "lambada")


def label(row: Row) -> str:
    """direction, method, k, calibration size, levers and corpus of a fit_eval run."""
    parts = [str(row.get("tags.direction", "?")), str(row.get("tags.method", "?")), f"k={row.get('params.fit.k')}"]
    if row.get("params.fit.sequences") not in (None, "None"):
        parts.append(f"n={row['params.fit.sequences']}")
    for name in ("native_sink", "hold_back", "native_layers"):
        if row.get(f"params.policy.levers.{name}") not in (None, "0"):
            parts.append(f"{name}={row[f'params.policy.levers.{name}']}")
    parts.append(str(row.get("params.budget.corpus")))
    return " ".join(parts)


def quickstart(rows: list[Row]) -> str:
    """The embedded default's record: every number the job logged that the README's plumbing claim rests on."""
    if len(rows) != 1:
        raise ValueError(f"the quickstart table reads exactly one record, found {len(rows)}: remove the stale ones")
    (row,) = rows
    weights = "random weights: plumbing only, never quality" if row.get("tags.weights") == "random" else "real weights"
    rollback = ("rollback_nan", "rollback_missing_layer", "rollback_dtype", "rollback_clean_transfers")
    cells = [
        ("recorded", provenance(row)),
        ("run", f"`{row['name']}` ({weights})"),
        ("held-out R² K / V", slashed(row, ("r2_k_heldout", "r2_v_heldout"), 3)),
        (
            "NLL native source / native target / transfer",
            slashed(row, ("nll_native_source", "nll_native_target", "nll_transfer"), 4),
        ),
        ("NLL gap recovered", slashed(row, ("nll_gap_recovered",), 3)),
        (
            f"apply p50 / p95 ({row.get('params.eval.latency.prefix_len')}-token prefix)",
            slashed(row, ("apply_ms_p50", "apply_ms_p95"), unit="ms"),
        ),
        ("target re-prefill p50 / p95", slashed(row, ("prefill_ms_p50", "prefill_ms_p95"), unit="ms")),
        ("trace collection / fit construction", slashed(row, ("trace_seconds", "construction_seconds"), unit="s")),
        ("calibration rows fit / held-out", slashed(row, ("calibration_rows", "heldout_rows"), 0)),
        ("coefficients / artifact bytes", slashed(row, ("coefficient_count", "artifact_bytes"), 0)),
        (
            "rollback checks (NaN, missing layer, wrong dtype → prefill; clean → transfer)",
            "all verified" if all(metric(row, name) == 1.0 for name in rollback) else "NOT verified",
        ),
    ]
    return "\n".join(["| metric | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in cells)])


def nll_table(rows: list[Row]) -> str:
    """Horizon NLL after a transferred prefix, against the share of the target's prefill still spent."""
    lines = [
        "| run | prefix tokens | prefill frac | NLL source | NLL target | NLL transfer | Δ vs target | NLL gap rec. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda row: (str(row.get("tags.direction")), metric(row, "prefill_fraction"))):
        nll = [metric(row, f"nll_{mode}") for mode in ("native_source", "native_target", "transfer")]
        cells = [label(row), str(row.get("params.eval.nll.prefix_len")), fmt(metric(row, "prefill_fraction"), 3)]
        cells += [fmt(value, 3) for value in nll] + [
            fmt(nll[2] - nll[1], 3),
            fmt(metric(row, "nll_gap_recovered"), 3),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def probe_table(rows: list[Row]) -> str:
    """Held-out (and fit) R² of the Head-Local design widened per variant (src/probe.py)."""
    lines = [
        "| pair | fit rows | variant | width K / V | R² K fit / held-out | R² V fit / held-out |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        fit_rows = fmt(metric(row, "calibration_rows"), 0)
        for variant in [v for v in VARIANTS if f"metrics.{v}.r2_v_heldout" in row]:
            width = slashed(row, (f"{variant}.width_k", f"{variant}.width_v"), 0)
            r2 = [slashed(row, (f"{variant}.r2_{c}_fit", f"{variant}.r2_{c}_heldout"), 3) for c in "kv"]
            lines.append(f"| {row.get('tags.direction')} | {fit_rows} | {variant} | {width} | " + " | ".join(r2) + " |")
    return "\n".join(lines)


def task_tables(rows: list[Row]) -> str:
    """Per-task accuracy (loss in points vs the native target [95% CI]) and the task means, one row per run."""
    head = ["run", "prefill frac", "NLL gap rec.", "R² K/V held-out", "R² K/V prompts"]
    lines = ["| " + " | ".join(head + [f"{t} acc (loss pt [95% CI])" for t in TASKS]) + " |"]
    lines.append("|" + "---|" * (len(head) + len(TASKS)))
    for native in ("source", "target"):  # the same items in every run: natives from the first
        accs = [fmt(metric(rows[0], f"task.{task}.acc_{native}"), 1, 100) for task in TASKS]
        lines.append(f"| native {native} | {1.0 if native == 'target' else 0.0} | | | | " + " | ".join(accs) + " |")
    for row in rows:
        cells = [
            label(row),
            fmt(metric(row, "task.mean.prefill_fraction"), 3),
            fmt(metric(row, "nll_gap_recovered"), 3),
            f"{fmt(metric(row, 'r2_k_heldout'), 3)} / {fmt(metric(row, 'r2_v_heldout'), 3)}",
            f"{fmt(metric(row, 'prompt_r2_k'), 3)} / {fmt(metric(row, 'prompt_r2_v'), 3)}",
        ]
        for task in TASKS:
            acc = metric(row, f"task.{task}.acc")
            loss = [metric(row, f"task.{task}.loss_points{suffix}") for suffix in ("", "_low", "_high")]
            cells.append(f"{fmt(acc, 1, 100)} ({fmt(loss[0])} [{fmt(loss[1])}, {fmt(loss[2])}])")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| run | mean acc | mean loss pt | worst-task loss pt | retention | gap recovered | mean task gap rec. |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for row in rows:
        values = [metric(row, f"task.mean.{name}") for name in ("acc", "loss_points", "max_loss_points")]
        ratios = [
            metric(row, f"task.mean.{name}") for name in ("retention", "gap_recovered", "mean_task_gap_recovered")
        ]
        lines.append(
            f"| {label(row)} | {fmt(values[0], 1, 100)} | {fmt(values[1])} | {fmt(values[2])} | "
            + " | ".join(fmt(r, 3) for r in ratios)
            + " |"
        )
    return "\n".join(lines)


def quality(rows: list[Row]) -> str:
    """Probe runs → probe table; fit_eval runs with tasks → task tables, without → horizon-NLL table."""
    sections = []
    if probes := [row for row in rows if row.get("tags.job") == "probe"]:
        sections.append(probe_table(probes))
    runs = [row for row in rows if row.get("tags.job") == "fit_eval"]
    if runs and any("metrics.task.mean.acc" in row for row in runs):
        sections.append(task_tables(runs))
    elif runs:
        sections.append(nll_table(runs))
    return "\n\n".join(sections)


def correlation(rows: list[Row], first: str, second: str) -> str:
    """Spearman's ρ [95 % CI] of two metrics over the runs that logged both (e.g. attention_output_cosine vs
    task.mean.retention: does a fidelity metric predict what the tasks keep?)."""
    pairs = [(metric(r, first), metric(r, second)) for r in rows]
    pairs = [(a, b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 3:
        return f"{first} vs {second}: {len(pairs)} run(s) logged both — at least 3 are needed"
    found = rank_correlation(*zip(*pairs, strict=True))
    return f"{first} vs {second}: Spearman ρ {found.estimate:+.2f} [{found.low:+.2f}, {found.high:+.2f}] over {len(pairs)} runs"
