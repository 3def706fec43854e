"""BENCHMARKS.md tables rebuilt from the committed tracking records in results/ (see results/README.md).

    python scripts/tables.py                        # rewrite every marked table in BENCHMARKS.md from results/
    python scripts/tables.py --mlflow EXP … --correlate attention_output_cosine task.mean.retention   # Spearman ρ
    python scripts/tables.py --check                # exit 1 naming each marked table that differs (tests do this)
    python scripts/tables.py quickstart             # print registered tables
    python scripts/tables.py --records DIR          # quality tables of any record folder (e.g. a device run's)
    python scripts/tables.py --mlflow EXPERIMENT... [--uri sqlite:///mlruns/mlflow.db]   # ... of an MLflow store

A marked table sits between `<!-- table: NAME -->` and `<!-- /table -->`; NAME is a key of TABLES, which names
its record set (a folder under results/) and the function that renders it. A row is one FINISHED record flattened
the way MLflow's search_runs names columns: `params.<dotted cfg key>`, `tags.<tag>`, `metrics.<key>` (the value
at the largest step), plus `series.<key>` ({step: value}) for stepped metrics.

Quality tables, per fit_eval run with tasks (one row): method, levers, prefill fraction, NLL gap recovered,
held-out / task-prompt R², and per task the headline accuracy with the loss in points against the native target
and its paired 95% CI; then the task means. Runs without tasks get the horizon-NLL table; probe runs
(+experiment=feature_probe) the fit / held-out R² per feature variant.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
RESULTS, BENCHMARKS = ROOT / "results", ROOT / "BENCHMARKS.md"
FEWSHOT_SHOTS = dict(OmegaConf.load(ROOT / "conf/workload/fewshot.yaml").shots)  # a run with more shows its count
sys.path.insert(0, str(ROOT))  # the gate's verdicts (src/gate.py) for the routed tables
from src.tracking import RecordError, read_items, read_record, require  # noqa: E402

MARKED = re.compile(r"(<!-- table: (\S+) -->\n)(.*?)(<!-- /table -->)", re.S)
VARIANTS = ("own", "kv", "token", "relu")  # src/probe.py, in that order
TASKS = ("hellaswag", "arc_easy", "arc_challenge", "winogrande", "piqa", "mmlu", "lambada")

Row = dict[str, object]


def record_rows(directory: Path) -> list[Row]:
    """One row per FINISHED record.json under `directory` (failed / interrupted runs are left out), oldest first."""
    rows = []
    for path in sorted(directory.glob("**/record.json")):
        record = read_record(path)  # a truncated record, or one without a key read here, names itself
        if record.get("status", "FINISHED") != "FINISHED":
            continue
        row: Row = {"name": record["name"], "start_time": record.get("start_time") or 0, "record": str(path)}
        row |= {f"params.{k}": v for k, v in record["params"].items()}
        row |= {f"tags.{k}": v for k, v in record["tags"].items()}
        for metric in sorted(record["metrics"], key=lambda m: (m["step"] or 0, m.get("timestamp") or 0)):
            row[f"metrics.{metric['key']}"] = metric["value"]
            if metric["step"] is not None:
                row.setdefault(f"series.{metric['key']}", {})[metric["step"]] = metric["value"]
        rows.append(row)
    return sorted(rows, key=lambda row: (row["start_time"], row["name"]))


def mlflow_rows(uri: str, experiments: list[str]) -> list[Row]:
    """The same rows from an MLflow store (no series)."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    found = mlflow.search_runs(experiment_names=experiments, filter_string="attributes.status = 'FINISHED'")
    rows = []
    for run in found.sort_values("start_time").to_dict("records"):
        row = {k: v for k, v in run.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        rows.append(row | {"name": run.get("tags.mlflow.runName"), "start_time": run["start_time"].value // 10**6})
    return rows


def _fmt(value: float | None, digits: int = 1, scale: float = 1.0) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value * scale:.{digits}f}"


def _metric(row: Row, name: str) -> float:
    return row.get(f"metrics.{name}", float("nan"))


def _label(row: Row) -> str:
    parts = [str(row.get("tags.direction", "?")), str(row.get("tags.method", "?")), f"k={row.get('params.fit.k')}"]
    if row.get("params.fit.sequences") not in (None, "None"):
        parts.append(f"n={row['params.fit.sequences']}")
    for name in ("native_sink", "hold_back", "native_layers"):
        if row.get(f"params.eval.levers.{name}") not in (None, "0"):
            parts.append(f"{name}={row[f'params.eval.levers.{name}']}")
    parts.append(str(row.get("params.budget.corpus")))
    return " ".join(parts)


def provenance(row: Row) -> str:
    """When, at which commit and on what a record was made (from its own tags)."""
    day = datetime.fromtimestamp(row["start_time"] / 1000, tz=UTC).strftime("%Y-%m-%d")
    commit = str(row.get("tags.git_commit", "unknown"))[:7] + (
        " (dirty)" if row.get("tags.git_dirty") == "True" else ""
    )
    device = row.get("tags.gpu") or f"{row.get('tags.host')} CPU"
    return f"{day}, git {commit}, torch {row.get('tags.torch')}, transformers {row.get('tags.transformers')}, {device}"


def _values(row: Row, names: tuple[str, ...], digits: int = 1, unit: str = "") -> str:
    """'a / b / c' of these metrics, formatted alike."""
    return " / ".join(_fmt(_metric(row, name), digits) for name in names) + (f" {unit}" if unit else "")


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
        ("held-out R² K / V", _values(row, ("r2_k_heldout", "r2_v_heldout"), 3)),
        (
            "NLL native source / native target / transfer",
            _values(row, ("nll_native_source", "nll_native_target", "nll_transfer"), 4),
        ),
        ("NLL gap recovered", _values(row, ("nll_gap_recovered",), 3)),
        (
            f"apply p50 / p95 ({row.get('params.eval.latency.prefix_len')}-token prefix)",
            _values(row, ("apply_ms_p50", "apply_ms_p95"), unit="ms"),
        ),
        ("target re-prefill p50 / p95", _values(row, ("prefill_ms_p50", "prefill_ms_p95"), unit="ms")),
        ("trace collection / fit construction", _values(row, ("trace_seconds", "construction_seconds"), unit="s")),
        ("calibration rows fit / held-out", _values(row, ("calibration_rows", "heldout_rows"), 0)),
        ("coefficients / artifact bytes", _values(row, ("coefficient_count", "artifact_bytes"), 0)),
        (
            "rollback checks (NaN, missing layer, wrong dtype → prefill; clean → transfer)",
            "all verified" if all(_metric(row, name) == 1.0 for name in rollback) else "NOT verified",
        ),
    ]
    return "\n".join(["| metric | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in cells)])


def nll_table(rows: list[Row]) -> str:
    """Horizon NLL after a transferred prefix, against the share of the target's prefill still spent."""
    lines = [
        "| run | prefix tokens | prefill frac | NLL source | NLL target | NLL transfer | Δ vs target | NLL gap rec. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda row: (str(row.get("tags.direction")), _metric(row, "prefill_fraction"))):
        nll = [_metric(row, f"nll_{mode}") for mode in ("native_source", "native_target", "transfer")]
        cells = [_label(row), str(row.get("params.eval.nll.prefix_len")), _fmt(_metric(row, "prefill_fraction"), 3)]
        cells += [_fmt(value, 3) for value in nll] + [
            _fmt(nll[2] - nll[1], 3),
            _fmt(_metric(row, "nll_gap_recovered"), 3),
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
        fit_rows = _fmt(_metric(row, "calibration_rows"), 0)
        for variant in [v for v in VARIANTS if f"metrics.{v}.r2_v_heldout" in row]:
            width = _values(row, (f"{variant}.width_k", f"{variant}.width_v"), 0)
            r2 = [_values(row, (f"{variant}.r2_{c}_fit", f"{variant}.r2_{c}_heldout"), 3) for c in "kv"]
            lines.append(f"| {row.get('tags.direction')} | {fit_rows} | {variant} | {width} | " + " | ".join(r2) + " |")
    return "\n".join(lines)


def task_tables(rows: list[Row]) -> str:
    """Per-task accuracy (loss in points vs the native target [95% CI]) and the task means, one row per run."""
    head = ["run", "prefill frac", "NLL gap rec.", "R² K/V held-out", "R² K/V prompts"]
    lines = ["| " + " | ".join(head + [f"{t} acc (loss pt [95% CI])" for t in TASKS]) + " |"]
    lines.append("|" + "---|" * (len(head) + len(TASKS)))
    for native in ("source", "target"):  # the same items in every run: natives from the first
        accs = [_fmt(_metric(rows[0], f"task.{task}.acc_{native}"), 1, 100) for task in TASKS]
        lines.append(f"| native {native} | {1.0 if native == 'target' else 0.0} | | | | " + " | ".join(accs) + " |")
    for row in rows:
        cells = [
            _label(row),
            _fmt(_metric(row, "task.mean.prefill_fraction"), 3),
            _fmt(_metric(row, "nll_gap_recovered"), 3),
            f"{_fmt(_metric(row, 'r2_k_heldout'), 3)} / {_fmt(_metric(row, 'r2_v_heldout'), 3)}",
            f"{_fmt(_metric(row, 'prompt_r2_k'), 3)} / {_fmt(_metric(row, 'prompt_r2_v'), 3)}",
        ]
        for task in TASKS:
            acc = _metric(row, f"task.{task}.acc")
            loss = [_metric(row, f"task.{task}.loss_points{suffix}") for suffix in ("", "_low", "_high")]
            cells.append(f"{_fmt(acc, 1, 100)} ({_fmt(loss[0])} [{_fmt(loss[1])}, {_fmt(loss[2])}])")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| run | mean acc | mean loss pt | worst-task loss pt | retention | gap recovered | mean task gap rec. |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for row in rows:
        values = [_metric(row, f"task.mean.{name}") for name in ("acc", "loss_points", "max_loss_points")]
        ratios = [
            _metric(row, f"task.mean.{name}") for name in ("retention", "gap_recovered", "mean_task_gap_recovered")
        ]
        lines.append(
            f"| {_label(row)} | {_fmt(values[0], 1, 100)} | {_fmt(values[1])} | {_fmt(values[2])} | "
            + " | ".join(_fmt(r, 3) for r in ratios)
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


def _ci(row: Row, name: str) -> str:
    """'value [low, high]' of a metric logged with its `_low` / `_high` paired bootstrap CI."""
    return (
        f"{_fmt(_metric(row, name))} [{_fmt(_metric(row, name + '_low'), 0)}, {_fmt(_metric(row, name + '_high'), 0)}]"
    )


def _loss(row: Row, prefix: str) -> str:
    """Loss in points of `<prefix>.loss_points` with its CI."""
    return _ci(row, f"{prefix}.loss_points")


def _routed_label(row: Row) -> str:
    levers = [
        f"{name}={row[f'params.eval.levers.{name}']}"
        for name in ("native_sink", "hold_back", "native_layers", "recompute")
        if row.get(f"params.eval.levers.{name}") not in (None, "0", "0.0")
    ]
    if levers and row.get("params.eval.levers.recompute") not in (None, "0", "0.0"):
        levers.append(f"rule={row.get('params.eval.levers.recompute_rule')}")
    if row.get("params.fit.v_space", "token") != "token":  # lever 3: the mapper fitted where the receiver reads
        levers.append(f"V fit in {row['params.fit.v_space']} space")
    if row.get("params.budget.continuation") not in (None, "0", "0.0"):  # lever 4: calibration the target wrote
        levers.append(f"calibration {float(row['params.budget.continuation']):.0%} target-greedy")
    if row.get("params.workload.policy", "map") != "map":  # the session chose per handoff (src/runtime/session.py)
        levers.insert(0, f"policy {row['params.workload.policy']}")
    arrow = str(row.get("tags.direction", "?")).replace("qwen25coder_", "").replace("_to_", " → ")
    notes = ["validation items"] if row.get("tags.split") == "valid" else []
    longer = [n for task, k in FEWSHOT_SHOTS.items() if (n := int(row.get(f"params.workload.shots.{task}", k))) > k]
    notes += [f"{max(longer)} shots"] if row.get("tags.workload") == "fewshot" and longer else []
    notes += ["bf16"] if row.get("params.pair.dtype") == "bfloat16" else []  # the models' weights and compute
    items = f" ({', '.join(notes)})" if notes else ""
    return f"{row.get('tags.workload')}{items} | {arrow} | {', '.join(levers) or 'pure transfer'}"


def _gate(row: Row) -> str:
    """The gate's verdict on this run (src/gate.py judge_run), with the criteria that did not pass."""
    from src.gate import backfill, judge_run

    metrics = {k[len("metrics.") :]: v for k, v in row.items() if k.startswith("metrics.")}
    params = {k[len("params.") :]: v for k, v in row.items() if k.startswith("params.")}
    metrics = backfill(metrics, _items(row), params)
    tags = {k[len("tags.") :]: str(v) for k, v in row.items() if k.startswith("tags.")}
    failing = [v for v in judge_run(metrics, tags) if not v.passed]
    names = {
        "latency: end-to-end TTFT speedup": "latency",
        "latency harness: same work alike": "latency harness",
        "quality: loss vs all-re-prefill": "quality",
        "prefill fraction spent": "prefill",
    }
    reasons = ", ".join(f"{names.get(v.criterion, v.criterion)} {v.status}" for v in failing)
    return f"FAIL ({reasons})" if failing else "PASS"


def _floor(row: Row) -> str:
    """Source alone minus the routed session on the mean, points [95 % CI] (> 0: escalating made answers worse);
    recomputed from the run's per-item scores (src/routed.py `quality`) where the record predates the metric."""
    name = "task.mean.below_source_points"
    if f"metrics.{name}" not in row:
        from src.routed import quality

        path = row["record"]
        n_boot, seed = (int(require(row, f"params.{key}", path)) for key in ("eval.tasks.n_boot", "seed"))
        found = quality(_items(row), n_boot, seed)
        row = row | {f"metrics.{key}": value for key, value in found.items()}
    return _ci(row, name)


def routed(rows: list[Row]) -> str:
    """One row per routed-workload run (src/routed.py): accuracy vs the all-re-prefill session, TTFT per path,
    prefill spent, handoffs, rollback, and the gate's verdict on that run alone."""
    lines = [
        "| workload | direction | levers | scored turns | acc routed / all-native / source (%) "
        "| mean loss pt [95 % CI] | below the source pt [95 % CI] | TTFT p50 routed / re-prefill / hit (ms) "
        "| p95 routed / re-prefill (ms) "
        "| TTFT speedup (median paired) | prefill spent | handoffs per turn | rollback | gate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        turns = sum(
            v for k, v in row.items() if k.startswith("metrics.task.") and k.endswith(".items") and ".mean." not in k
        )
        lines.append(
            f"| {_routed_label(row)} | {turns:.0f} "
            f"| {' / '.join(_fmt(_metric(row, f'task.mean.{n}'), 1, 100) for n in ('acc', 'acc_target', 'acc_source'))} "
            f"| {_loss(row, 'task.mean')} | {_floor(row)} "
            f"| {_values(row, ('ttft.routed_ms_p50', 'ttft.reprefill_ms_p50', 'ttft.hit_ms_p50'))} "
            f"| {_values(row, ('ttft.routed_ms_p95', 'ttft.reprefill_ms_p95'))} "
            f"| {_fmt(_metric(row, 'ttft_speedup'), 2)}× | {_fmt(_metric(row, 'prefill_fraction'), 0, 100)} % "
            f"| {_fmt(_metric(row, 'handoff_frequency'), 2)} "
            f"| {'verified' if _metric(row, 'rollback_verified') == 1.0 else 'NOT verified'} | {_gate(row)} |"
        )
    return "\n".join(lines)


def routed_tasks(rows: list[Row]) -> str:
    """Per task of each routed run: routed accuracy (%) and loss in points vs the all-native session [95 % CI]."""
    lines = [
        "| workload | direction | levers | task: acc routed / all-native (loss pt [95 % CI]) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        tasks = sorted(
            {k.split(".")[2] for k in row if k.startswith("metrics.task.") and k.endswith(".acc")} - {"mean"}
        )
        cells = [
            f"{task} {_fmt(_metric(row, f'task.{task}.acc'), 0, 100)} / {_fmt(_metric(row, f'task.{task}.acc_target'), 0, 100)}"
            f" ({_loss(row, f'task.{task}')})"
            for task in tasks
        ]
        lines.append(f"| {_routed_label(row)} | {'; '.join(cells)} |")
    return "\n".join(lines)


def routed_switches(rows: list[Row]) -> str:
    """Final-turn quality after s model switches (the switches workload): per s, the mean and each task."""
    (row,) = [row for row in rows if row.get("tags.workload") == "switches"]
    keys = [k.split(".") for k in row if k.startswith("metrics.switches.s")]  # metrics.switches.s<N>.<task>.<name>
    counts, tasks = sorted({int(k[2][1:]) for k in keys}), sorted({k[3] for k in keys} - {"mean"})
    lines = [
        "| switches | mean acc routed / all-native / source (%) | mean loss pt [95 % CI] | "
        + " | ".join(f"{task} loss pt [95 % CI]" for task in tasks)
        + " | NLL routed / all-native (reference answers) |",
        "|---|---|---|" + "---|" * len(tasks) + "---|",
    ]
    for s in counts:
        prefix = f"switches.s{s}"
        acc = (f"{prefix}.mean.acc", f"{prefix}.mean.acc_target", f"{prefix}.mean.acc_source")
        lines.append(
            f"| {s} | {' / '.join(_fmt(_metric(row, name), 1, 100) for name in acc)} | {_loss(row, f'{prefix}.mean')} | "
            + " | ".join(_loss(row, f"{prefix}.{task}") for task in tasks)
            + f" | {_values(row, (f'{prefix}.mean.nll_routed', f'{prefix}.mean.nll_native_target'), 3)} |"
        )
    return "\n".join(lines)


def _items(row: Row) -> list[dict]:
    """The per-item rows of a routed record (artifacts/routed/items.json beside it); a damaged file names itself."""
    return read_items(Path(str(row["record"])).parent)


def routed_paired(rows: list[Row], run_set: str | None = None) -> str:
    """Levers compared on the same items (src/routed.py `paired_gain`): within one direction and workload (its shots,
    dtype and item split), every two recompute runs whose prefill spent differs by ≤ 5 points (equal compute), and every lever run
    against pure transfer (with `run_set`: only pairs with a run of that results/ folder), when they share at least
    half the items of the smaller run. Accuracy of the first minus the second, points [95 % CI]."""
    from src.routed import paired_gain

    group = lambda r: _routed_label(r).split(" | ")[:2]  # workload (its shots, dtype, item split) and direction
    recompute = lambda r: float(r.get("params.eval.levers.recompute") or 0) > 0
    pure = lambda r: _routed_label(r).endswith("pure transfer")
    pairs = []
    for i, first in enumerate(rows):
        for second in rows[i + 1 :]:
            if group(first) != group(second) or (
                run_set
                and run_set not in Path(str(first["record"])).parts
                and run_set not in Path(str(second["record"])).parts
            ):
                continue
            spent = abs(_metric(first, "prefill_fraction") - _metric(second, "prefill_fraction"))
            if recompute(first) and recompute(second) and spent <= 0.05:
                pairs.append((first, second))
            elif pure(first) != pure(second):
                pairs.append((second, first) if pure(first) else (first, second))
    lines = [
        "| workload | direction | run A | run B | prefill A / B | items paired | acc A − B, pt [95 % CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    key = lambda item: (item["task"], item["index"])
    for first, second in pairs:
        mine, theirs = _items(first), _items(second)
        shared = len({key(item) for item in mine} & {key(item) for item in theirs})
        if 2 * shared < min(len(mine), len(theirs)):  # other item limits: a few items in common say nothing
            continue
        n_boot, seed = (int(require(first, f"params.{key}", first["record"])) for key in ("eval.tasks.n_boot", "seed"))
        found = paired_gain(mine, theirs, n_boot, seed)
        workload, arrow, levers = _routed_label(first).split(" | ")
        lines.append(
            f"| {workload} | {arrow} | {levers} | {_routed_label(second).split(' | ')[2]} "
            f"| {_fmt(_metric(first, 'prefill_fraction'), 0, 100)} / {_fmt(_metric(second, 'prefill_fraction'), 0, 100)} % "
            f"| {shared} | {100 * found.estimate:+.1f} [{100 * found.low:+.0f}, {100 * found.high:+.0f}] |"
        )
    return "\n".join(lines)


def _step(row: Row, name: str, step: int) -> float:
    return float(row.get(f"series.{name}", {}).get(step, math.nan))


def engine(rows: list[Row]) -> str:
    """Handoff TTFT per history length on each engine (+experiment=handoff, src/eval/ttft.py): the map alone, each
    engine's map (routed TTFT) / faster re-prefill / prefix hit (ms, p50), the routed speedup and routed / hit on the
    graph engine, fused recompute's speedups; one block per record."""
    lines = []
    for row in rows:
        if row.get("params.job") != "handoff":
            continue
        engines = [e for e in ("hf", "static", "graph") if f"series.ttft.{e}.map_ms_p50" in row]
        shares = sorted(
            key.removeprefix("series.speedup.graph.recompute_")
            for key in row
            if key.startswith("series.speedup.graph.recompute_")
        )
        arrow = str(row.get("tags.direction", "?")).replace("qwen25coder_", "").replace("_to_", " → ")
        lines += [
            f"{arrow}, {row.get('params.pair.dtype')}, random weights, new turn {row.get('params.eval.handoff.new_turn')}"
            f" tokens — {provenance(row)}",
            "",
            "| history | map alone | "
            + " | ".join(f"{e}: map / re-prefill / hit (ms)" for e in engines)
            + " | graph: speedup, routed / hit | "
            + " | ".join(f"recompute {float(r):.0%}" for r in shares)
            + " |",
            "|" + "---|" * (3 + len(engines) + len(shares)),
        ]
        for step in sorted(row["series.map_ms_p50"]):
            cells = [f"{step:,}", _fmt(_step(row, "map_ms_p50", step), 2)]
            for e in engines:
                base = "reprefill_best" if f"series.ttft.{e}.reprefill_best_ms_p50" in row else "reprefill"
                cells.append(
                    " / ".join(_fmt(_step(row, f"ttft.{e}.{p}_ms_p50", step), 1) for p in ("map", base, "hit"))
                )
            speedup, ratio = _step(row, "speedup.graph.map", step), _step(row, "graph.map_over_hit", step)
            cells.append(f"{_fmt(speedup, 2)}×, {_fmt(ratio, 2)}×")
            cells += [f"{_fmt(_step(row, f'speedup.graph.recompute_{r}', step), 2)}×" for r in shares]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


@dataclass(frozen=True)
class Table:
    run_sets: tuple[str, ...]  # folders under results/
    render: Callable[[list[Row]], str]


ROUTED, LEVERS, FITS = "routed-h200-2026-12-03", "routed2-h200-2026-12-03", "routed3-h200-2026-12-04"
BF16 = "routed4-h200-2026-12-04"
ENGINE = "engine-h200-2026-12-05"
TABLES: dict[str, Table] = {
    "quickstart": Table(("quickstart-cpu",), quickstart),
    "routed": Table((ROUTED,), routed),
    "routed_tasks": Table((ROUTED,), routed_tasks),
    "routed_switches": Table((ROUTED,), routed_switches),
    "routed_levers": Table((LEVERS,), routed),
    "routed_levers_tasks": Table((LEVERS,), routed_tasks),
    "routed_levers_paired": Table((ROUTED, LEVERS), routed_paired),
    "routed_fits": Table((FITS,), routed),
    "routed_fits_tasks": Table((FITS,), routed_tasks),
    "routed_fits_paired": Table((ROUTED, FITS), partial(routed_paired, run_set=FITS)),
    "routed_bf16": Table((BF16,), routed),
    "routed_bf16_tasks": Table((BF16,), routed_tasks),
    "routed_bf16_paired": Table((ROUTED, LEVERS, FITS, BF16), partial(routed_paired, run_set=BF16)),
    "engine": Table((ENGINE,), engine),
}


def build(name: str, results: Path = RESULTS) -> str:
    """The table NAME rebuilt from its record set."""
    if name not in TABLES:
        raise ValueError(f"no table {name!r} in scripts/tables.py TABLES (registered: {sorted(TABLES)})")
    table = TABLES[name]
    rows = [row for run_set in table.run_sets for row in record_rows(results / run_set)]
    if not rows:
        raise ValueError(
            f"table {name!r}: {[str(results / s) for s in table.run_sets]}: none holds a FINISHED record.json"
        )
    return table.render(sorted(rows, key=lambda row: (row["start_time"], row["name"])))


def marked(text: str) -> dict[str, str]:
    """NAME → the table text between its markers (without the trailing newline)."""
    found: dict[str, str] = {}
    for match in MARKED.finditer(text):
        if match.group(2) in found:
            raise ValueError(f"table {match.group(2)!r} is marked twice")
        found[match.group(2)] = match.group(3).rstrip("\n")
    return found


def rebuild(text: str, results: Path = RESULTS) -> str:
    """`text` with every marked table replaced by its rebuild; a registered table without a marker is an error."""
    missing = sorted(set(TABLES) - set(marked(text)))
    if missing:
        raise ValueError(f"registered tables without a `<!-- table: NAME -->` marker in BENCHMARKS.md: {missing}")
    return MARKED.sub(lambda m: f"{m.group(1)}{build(m.group(2), results)}\n{m.group(4)}", text)


def stale(text: str, results: Path = RESULTS) -> list[str]:
    """Names of the marked tables whose text differs from their rebuild."""
    fresh = marked(rebuild(text, results))
    return [name for name, table in marked(text).items() if table != fresh[name]]


def correlation(rows: list[Row], first: str, second: str) -> str:
    """Spearman's ρ [95 % CI] of two metrics over the runs that logged both (e.g. attention_output_cosine vs
    task.mean.retention: does a fidelity metric predict what the tasks keep?)."""
    from src.eval.metrics import rank_correlation

    pairs = [(_metric(r, first), _metric(r, second)) for r in rows]
    pairs = [(a, b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 3:
        return f"{first} vs {second}: {len(pairs)} run(s) logged both — at least 3 are needed"
    found = rank_correlation(*zip(*pairs, strict=True))
    return f"{first} vs {second}: Spearman ρ {found.estimate:+.2f} [{found.low:+.2f}, {found.high:+.2f}] over {len(pairs)} runs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="tables to print (TABLES keys), or experiments with --mlflow")
    parser.add_argument("--check", action="store_true", help="exit 1 when a marked table differs from its rebuild")
    parser.add_argument("--records", type=Path, help="print the quality tables of the records under this folder")
    parser.add_argument("--mlflow", action="store_true", help="print the quality tables of these MLflow experiments")
    parser.add_argument("--uri", default="sqlite:///mlruns/mlflow.db")
    parser.add_argument("--correlate", nargs=2, metavar=("METRIC", "METRIC"), help="rank correlation over the runs")
    args = parser.parse_args()
    try:
        if args.correlate:
            rows = record_rows(args.records) if args.records else mlflow_rows(args.uri, args.names)
            print(correlation(rows, *args.correlate))
        elif args.records:
            print(quality(record_rows(args.records)))
        elif args.mlflow:
            print(quality(mlflow_rows(args.uri, args.names)))
        elif args.names:
            print("\n\n".join(build(name) for name in args.names))
        elif args.check:
            if differ := stale(BENCHMARKS.read_text()):
                sys.exit(
                    f"BENCHMARKS.md tables differ from their rebuild from results/: {differ} "
                    "(run `python scripts/tables.py` and review the diff)"
                )
            print(f"{len(marked(BENCHMARKS.read_text()))} marked table(s) equal their rebuild from results/")
        else:
            text = BENCHMARKS.read_text()
            BENCHMARKS.write_text(rebuild(text))
            print(f"rebuilt {len(marked(text))} table(s) in {BENCHMARKS.name}: {sorted(marked(text))}")
    except RecordError as error:
        sys.exit(f"tables: {error}")


if __name__ == "__main__":
    main()
