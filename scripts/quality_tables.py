"""Markdown tables of the real-pair quality runs, read from the MLflow store (for BENCHMARKS.md).

    python scripts/quality_tables.py real_attribution real_domain real_levers [--uri sqlite:///mlruns/mlflow.db]

Per fit_eval run with tasks (one row): method, levers, prefill fraction, NLL gap recovered, held-out /
task-prompt R², and per task the headline accuracy with the loss in points against the native target and its
paired 95% CI; then the task means (accuracy, loss, worst-task loss, retention, gap recovered). Runs without
tasks get the horizon-NLL table (prefix length, prefill fraction, NLL of both natives and the transfer);
probe runs (+experiment=feature_probe) the fit / held-out R² per feature variant.
"""

from __future__ import annotations

import argparse
import math

import mlflow

VARIANTS = ("own", "kv", "token", "relu")  # src/probe.py, in that order
TASKS = ("hellaswag", "arc_easy", "arc_challenge", "winogrande", "piqa", "mmlu", "lambada")


def _fmt(value: float, digits: int = 1, scale: float = 1.0) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value * scale:.{digits}f}"


def _label(row) -> str:
    params = row.filter(like="params.").to_dict()
    method = row.get("tags.method", "?")
    parts = [str(row.get("tags.direction", "?")), method, f"k={params.get('params.fit.k')}"]
    if params.get("params.fit.sequences") not in (None, "None"):
        parts.append(f"n={params['params.fit.sequences']}")
    levers = [
        (name, params.get(f"params.eval.levers.{name}")) for name in ("native_sink", "hold_back", "native_layers")
    ]
    parts += [f"{name}={value}" for name, value in levers if value not in (None, "0")]
    parts.append(str(params.get("params.budget.corpus")))
    return " ".join(parts)


def _metric(row, name: str) -> float:
    return row.get(f"metrics.{name}", float("nan"))


def nll_table(runs) -> str:
    """Horizon NLL after a transferred prefix, against the share of the target's prefill still spent."""
    lines = [
        "| run | prefix tokens | prefill frac | NLL source | NLL target | NLL transfer | Δ vs target | NLL gap rec. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    runs = runs.assign(_frac=runs["metrics.prefill_fraction"]).sort_values(["tags.direction", "_frac"])
    for _, row in runs.iterrows():
        nll = [_metric(row, f"nll_{mode}") for mode in ("native_source", "native_target", "transfer")]
        cells = [_label(row), str(row.get("params.eval.nll.prefix_len")), _fmt(_metric(row, "prefill_fraction"), 3)]
        cells += [_fmt(value, 3) for value in nll] + [
            _fmt(nll[2] - nll[1], 3),
            _fmt(_metric(row, "nll_gap_recovered"), 3),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def probe_table(runs) -> str:
    """Held-out (and fit) R² of the Head-Local design widened per variant (src/probe.py)."""
    lines = [
        "| pair | fit rows | variant | width K / V | R² K fit / held-out | R² V fit / held-out |",
        "|---|---|---|---|---|---|",
    ]
    for _, row in runs.iterrows():
        rows = _fmt(_metric(row, "calibration_rows"), 0)
        for variant in [v for v in VARIANTS if f"metrics.{v}.r2_v_heldout" in row.index]:
            width = f"{_fmt(_metric(row, f'{variant}.width_k'), 0)} / {_fmt(_metric(row, f'{variant}.width_v'), 0)}"
            r2 = [
                f"{_fmt(_metric(row, f'{variant}.r2_{c}_fit'), 3)} / {_fmt(_metric(row, f'{variant}.r2_{c}_heldout'), 3)}"
                for c in "kv"
            ]
            lines.append(f"| {row.get('tags.direction')} | {rows} | {variant} | {width} | " + " | ".join(r2) + " |")
    return "\n".join(lines)


def tables(uri: str, experiments: list[str]) -> str:
    mlflow.set_tracking_uri(uri)
    found = mlflow.search_runs(experiment_names=experiments).sort_values("start_time")
    sections = []
    probes = found[found["tags.job"] == "probe"].dropna(axis=1, how="all")
    if len(probes):
        sections.append(probe_table(probes))
    runs = found[found["tags.job"] == "fit_eval"]
    if len(runs) and "metrics.task.mean.acc" not in runs.dropna(axis=1, how="all"):
        sections.append(nll_table(runs))
    elif len(runs):
        sections.append(task_tables(runs))
    return "\n\n".join(sections)


def task_tables(runs) -> str:
    head = ["run", "prefill frac", "NLL gap rec.", "R² K/V held-out", "R² K/V prompts"]
    lines = ["| " + " | ".join(head + [f"{t} acc (loss pt [95% CI])" for t in TASKS]) + " |"]
    lines.append("|" + "---|" * (len(head) + len(TASKS)))
    first = runs.iloc[0]
    for native in ("source", "target"):  # the same items in every run: natives from the first
        accs = [_fmt(_metric(first, f"task.{task}.acc_{native}"), 1, 100) for task in TASKS]
        lines.append(f"| native {native} | {1.0 if native == 'target' else 0.0} | | | | " + " | ".join(accs) + " |")
    for _, row in runs.iterrows():
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
    for _, row in runs.iterrows():
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiments", nargs="+")
    parser.add_argument("--uri", default="sqlite:///mlruns/mlflow.db")
    args = parser.parse_args()
    print(tables(args.uri, args.experiments))


if __name__ == "__main__":
    main()
