"""Markdown tables of the real-pair quality runs, read from the MLflow store (for BENCHMARKS.md).

    python scripts/quality_tables.py real_attribution real_domain real_levers [--uri sqlite:///mlruns/mlflow.db]

Per run (one row): method, levers, prefill fraction, NLL gap recovered, held-out / task-prompt R², and per
task the headline accuracy with the loss in points against the native target and its paired 95% CI; then
the task means (accuracy, loss, worst-task loss, retention, gap recovered).
"""

from __future__ import annotations

import argparse
import math

import mlflow

TASKS = ("hellaswag", "arc_easy", "arc_challenge", "winogrande", "piqa", "mmlu", "lambada")


def _fmt(value: float, digits: int = 1, scale: float = 1.0) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value * scale:.{digits}f}"


def _label(row) -> str:
    params = row.filter(like="params.").to_dict()
    method = row.get("tags.method", "?")
    parts = [method, f"k={params.get('params.fit.k')}"]
    if params.get("params.fit.sequences") not in (None, "None"):
        parts.append(f"n={params['params.fit.sequences']}")
    levers = [
        (name, params.get(f"params.eval.levers.{name}")) for name in ("native_sink", "hold_back", "native_layers")
    ]
    parts += [f"{name}={value}" for name, value in levers if value not in (None, "0")]
    parts.append(str(params.get("params.budget.corpus")))
    return " ".join(parts)


def tables(uri: str, experiments: list[str]) -> str:
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=experiments, filter_string="tags.job = 'fit_eval'")
    runs = runs.sort_values("start_time")
    metric = lambda row, name: row.get(f"metrics.{name}", float("nan"))
    head = ["run", "prefill frac", "NLL gap rec.", "R² K/V held-out", "R² K/V prompts"]
    lines = ["| " + " | ".join(head + [f"{t} acc (loss pt [95% CI])" for t in TASKS]) + " |"]
    lines.append("|" + "---|" * (len(head) + len(TASKS)))
    first = runs.iloc[0]
    for native in ("source", "target"):  # the same items in every run: natives from the first
        accs = [_fmt(metric(first, f"task.{task}.acc_{native}"), 1, 100) for task in TASKS]
        lines.append(f"| native {native} | {1.0 if native == 'target' else 0.0} | | | | " + " | ".join(accs) + " |")
    for _, row in runs.iterrows():
        cells = [
            _label(row),
            _fmt(metric(row, "task.mean.prefill_fraction"), 3),
            _fmt(metric(row, "nll_gap_recovered"), 3),
            f"{_fmt(metric(row, 'r2_k_heldout'), 3)} / {_fmt(metric(row, 'r2_v_heldout'), 3)}",
            f"{_fmt(metric(row, 'prompt_r2_k'), 3)} / {_fmt(metric(row, 'prompt_r2_v'), 3)}",
        ]
        for task in TASKS:
            acc = metric(row, f"task.{task}.acc")
            loss = [metric(row, f"task.{task}.loss_points{suffix}") for suffix in ("", "_low", "_high")]
            cells.append(f"{_fmt(acc, 1, 100)} ({_fmt(loss[0])} [{_fmt(loss[1])}, {_fmt(loss[2])}])")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| run | mean acc | mean loss pt | worst-task loss pt | retention | gap recovered | mean task gap rec. |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for _, row in runs.iterrows():
        values = [metric(row, f"task.mean.{name}") for name in ("acc", "loss_points", "max_loss_points")]
        ratios = [
            metric(row, f"task.mean.{name}") for name in ("retention", "gap_recovered", "mean_task_gap_recovered")
        ]
        lines.append(
            f"| {_label(row)} | {_fmt(values[0], 1, 100)} | {_fmt(values[1])} | {_fmt(values[2])} | "
            + " | ".join(_fmt(r, 3) for r in ratios)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiments", nargs="+")
    parser.add_argument("--uri", default="sqlite:///mlruns/mlflow.db")
    args = parser.parse_args()
    print(tables(args.uri, args.experiments))


if __name__ == "__main__":
    main()
