"""Does an error signal predict what routing costs the receiver? (issue 25): a signal that predicts accuracy, or its
absence shown, so the next lever is chosen by it.

Over routed run records (record.json + artifacts/routed/items.json, tracking.backend=json):

  run level   Spearman's ρ between a run's signal and its task loss in points vs the native receiver
              (`task.mean.loss_points`), with a percentile-bootstrap CI over runs (runs resampled with their loss);
  item level  within each run, Spearman's ρ between an item's signal and whether the routed answer lost the native
              one's correctness (native right, routed wrong: 1, else 0); their mean over runs, with a CI that
              resamples items within each run (a run without a lost item, or a constant signal, has no ρ: counted).

Every signal is oriented so that higher = more error: the receiver's read error (`read_error.*`,
src/eval/read_error.py: eval.diagnose.read_error), the mapper's cache fidelity on the mapped histories
(`fidelity.*`: eval.diagnose.fidelity — the mapper's, computed without the levers, so lever settings of one mapper
share one value; the `distinct` column shows it), and the NLL the routed receiver adds to the scored answers — an
outcome proxy read off the same answers the loss counts, not a cache signal. With fewer than `--min-runs` (20, the
issue's) runs a ρ is printed as exploratory, never a headline; every ρ carries its n and CI.

    python -m src.report.error_signal RECORD_DIR... [--experiment NAME] [--workload NAME] [--random] [--min-runs 20]
        [--n-boot 2000] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from src.eval.metrics import Interval
from src.records import items_path, metric_values, read_items, read_record
from src.routed_runs import task_scores
from src.tasks import METRICS

MIN_RUNS = 20  # the floor: fewer runs give an exploratory ρ, never a headline
LEVEL = 0.95
nan = math.nan
RUN_SIGNALS: dict[str, Callable[[dict[str, float]], float]] = {  # higher = more error
    "read_error": lambda m: m.get("read_error.mean", nan),
    "read_error_max": lambda m: m.get("read_error.max", nan),
    "fidelity_1-r2_k": lambda m: 1 - m.get("fidelity.prompt_r2_k", nan),
    "fidelity_1-r2_v": lambda m: 1 - m.get("fidelity.prompt_r2_v", nan),
    "fidelity_1-attention_cos": lambda m: 1 - m.get("fidelity.attention_output_cosine", nan),
    "nll_delta (outcome proxy)": lambda m: (
        m.get("task.mean.nll_routed", nan) - m.get("task.mean.nll_native_target", nan)
    ),
}
ITEM_SIGNALS: dict[str, Callable[[dict], float]] = {
    "read_error": lambda item: item["read_error"]["mean"] if item.get("read_error") else nan,
    "read_error_max": lambda item: item["read_error"]["max"] if item.get("read_error") else nan,
    "nll_delta (outcome proxy)": lambda item: item["nll"]["routed"] - item["nll"]["native_target"],
}


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks (1-based) along the last axis, tied values sharing their mean rank: [..., n] → [..., n]."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    flat = x.reshape(-1, n)  # [R, n]
    order = np.argsort(flat, axis=-1, kind="stable")  # [R, n]
    ordered = np.take_along_axis(flat, order, -1)
    new = np.ones_like(ordered, dtype=bool)
    new[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    group = np.cumsum(new.ravel()) - 1  # [R·n] tie groups, row-major: none spans two rows
    counts = np.bincount(group)
    ends = np.cumsum(counts)  # each group's last rank, counted over all rows
    rows = np.repeat(np.arange(flat.shape[0]), n)  # [R·n]
    mean_rank = ends[group] - (counts[group] - 1) / 2 - rows * n  # [R·n]
    ranks = np.empty_like(flat)
    np.put_along_axis(ranks, order, mean_rank.reshape(flat.shape), -1)
    return ranks.reshape(x.shape)


def spearman(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's ρ along the last axis (Pearson's r of the average ranks): [..., n] → [...]; NaN where x or y is
    constant."""
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(-1, keepdims=True), ry - ry.mean(-1, keepdims=True)
    spread = np.sqrt((rx * rx).sum(-1) * (ry * ry).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(spread > 0, (rx * ry).sum(-1) / spread, nan)


def _interval(estimate: float, boot: np.ndarray, level: float) -> Interval:
    boot = boot[np.isfinite(boot)]  # resamples where a side came out constant have no ρ
    if not math.isfinite(estimate) or boot.size == 0:
        return Interval(estimate, nan, nan)
    low, high = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return Interval(estimate, float(low), float(high))


def spearman_ci(x: np.ndarray, y: np.ndarray, n_boot: int, seed: int, level: float = LEVEL) -> Interval:
    """ρ(x, y) over n paired observations with a percentile-bootstrap CI (pairs resampled together)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"a rank correlation needs two [n] arrays, got {x.shape} and {y.shape}")
    if x.size < 3:
        return Interval(nan, nan, nan)
    draws = np.random.default_rng(seed).integers(0, x.size, (n_boot, x.size))  # [B, n]
    return _interval(float(spearman(x, y)), spearman(x[draws], y[draws]), level)


def within_ci(groups: list[tuple[np.ndarray, np.ndarray]], n_boot: int, seed: int, level: float = LEVEL) -> Interval:
    """The mean over groups (runs) of ρ(x, y) within each, with a CI from resampling observations within each group
    (stratified); groups given must each have a ρ."""
    if not groups:
        return Interval(nan, nan, nan)
    rng = np.random.default_rng(seed)
    boot = []
    for x, y in groups:
        draws = rng.integers(0, x.size, (n_boot, x.size))  # [B, n_g]
        boot.append(spearman(x[draws], y[draws]))  # [B]
    boot = np.stack(boot)  # [G, B]
    finite = np.isfinite(boot)
    with np.errstate(invalid="ignore"):
        pooled = np.where(finite, boot, 0).sum(0) / finite.sum(0)  # [B]: a resample's mean over its defined ρ
    return _interval(float(np.mean([spearman(x, y) for x, y in groups])), pooled, level)


def lost(items: list[dict]) -> np.ndarray:
    """Per item [N]: 1.0 where the native receiver answered right and the routed one wrong, else 0.0."""
    out = np.zeros(len(items))
    for task in sorted({item["task"] for item in items}):
        where = [i for i, item in enumerate(items) if item["task"] == task]
        rows = [items[i] for i in where]
        native, routed = (task_scores(rows, mode).correct(METRICS[task][0]) for mode in ("native_target", "routed"))
        out[where] = native & ~routed
    return out


def read_runs(
    directories: list[Path], experiment: str | None = None, workload: str | None = None, with_random: bool = False
) -> tuple[list[dict], dict]:
    """FINISHED routed runs under the directories (of `experiment` and `workload`, where named; random weights only
    `with_random`): name, record, loss in points, run signals and, where the items artifact exists, per-item signals
    and `lost`; and how many records were left out, by reason."""
    runs, skipped = [], {"random weights": 0, "other experiment": 0, "other workload": 0}
    for path in sorted(p for directory in directories for p in Path(directory).glob("**/record.json")):
        record = read_record(path)
        tags = record["tags"]
        if record.get("status") != "FINISHED" or tags.get("job") != "routed":
            continue
        if experiment is not None and record.get("experiment") != experiment:
            skipped["other experiment"] += 1
            continue
        if workload is not None and tags.get("workload") != workload:
            skipped["other workload"] += 1
            continue
        if tags.get("weights") == "random" and not with_random:
            skipped["random weights"] += 1
            continue
        metrics = metric_values(record, path)
        run = {
            "name": record["name"],
            "record": str(path),
            "loss_points": metrics.get("task.mean.loss_points", nan),
            "signals": {name: float(signal(metrics)) for name, signal in RUN_SIGNALS.items()},
        }
        if items_path(path.parent).is_file():
            items = read_items(path.parent)
            run["lost"] = lost(items)
            run["items"] = {name: np.array([signal(item) for item in items]) for name, signal in ITEM_SIGNALS.items()}
        runs.append(run)
    return runs, skipped


def analyse(runs: list[dict], min_runs: int, n_boot: int, seed: int) -> dict:
    """Run- and item-level rank correlations of every signal (module docstring) as a JSON-able dict."""
    result = {"min_runs": min_runs, "level": LEVEL, "n_boot": n_boot, "run_level": {}, "item_level": {}}
    for name in RUN_SIGNALS:
        pairs = [(r["signals"][name], r["loss_points"]) for r in runs]
        pairs = np.array([p for p in pairs if all(map(math.isfinite, p))]).reshape(-1, 2)  # [n, 2]
        found = spearman_ci(pairs[:, 0], pairs[:, 1], n_boot, seed)
        result["run_level"][name] = {
            "runs": len(pairs),
            "distinct": len(np.unique(pairs[:, 0])),
            "rho": found.estimate,
            "low": found.low,
            "high": found.high,
            "enough_runs": len(pairs) >= min_runs,
        }
    for name in ITEM_SIGNALS:
        groups, per_run, without = [], [], 0
        for r in (r for r in runs if "items" in r):
            signal, lost_items = r["items"][name], r["lost"]
            kept = np.isfinite(signal)
            if not kept.any():
                continue
            x, y = signal[kept], lost_items[kept]
            if not math.isfinite(float(spearman(x, y))):
                without += 1  # no lost item, or a constant signal
                continue
            found = spearman_ci(x, y, n_boot, seed)
            groups.append((x, y))
            per_run.append({"name": r["name"], "items": int(x.size), "lost": int(y.sum())}
                           | {"rho": found.estimate, "low": found.low, "high": found.high})  # fmt: skip
        pooled = within_ci(groups, n_boot, seed)
        result["item_level"][name] = {
            "runs": len(groups),
            "runs_without_rho": without,
            "items": int(sum(x.size for x, _ in groups)),
            "lost": int(sum(y.sum() for _, y in groups)),
            "rho": pooled.estimate,
            "low": pooled.low,
            "high": pooled.high,
            "per_run": per_run,
        }
    return result


def _cell(value: float) -> str:
    return "—" if not math.isfinite(value) else f"{value:+.2f}"


def table(result: dict, skipped: dict) -> str:
    """The result as two markdown tables, the run-count verdict under the first."""
    left = ", ".join(f"{n} {why}" for why, n in skipped.items() if n) or "none"
    lines = [
        f"Run level: Spearman ρ of each signal (higher = more error) vs the run's loss in points against the native "
        f"receiver; {100 * result['level']:.0f} % bootstrap CI over runs ({result['n_boot']} resamples). Records left "
        f"out: {left}.",
        "",
        "| signal | runs | distinct values | ρ | CI | verdict |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, row in result["run_level"].items():
        if row["runs"] < 3:
            verdict = "too few runs"
        elif not row["enough_runs"]:
            verdict = f"n < {result['min_runs']}: exploratory, not a headline"
        elif row["low"] > 0:
            verdict = "more error, more loss (CI above 0)"
        else:
            verdict = "no signal shown (CI covers 0)" if row["high"] >= 0 else "inverse (CI below 0)"
        ci = f"[{_cell(row['low'])}, {_cell(row['high'])}]"
        lines.append(f"| {name} | {row['runs']} | {row['distinct']} | {_cell(row['rho'])} | {ci} | {verdict} |")
    most = max((row["runs"] for row in result["run_level"].values()), default=0)
    if most < result["min_runs"]:
        lines += ["", f"At most {most} runs carry a signal: fewer than the {result['min_runs']} the issue asks for."]
    lines += [
        "",
        "Item level: within each run, Spearman ρ of an item's signal vs its lost correctness (native right, routed "
        "wrong); the mean over runs, CI resampling items within runs.",
        "",
        "| signal | runs | runs without ρ | items | lost | mean ρ | CI |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in result["item_level"].items():
        ci = f"[{_cell(row['low'])}, {_cell(row['high'])}]"
        lines.append(f"| {name} | {row['runs']} | {row['runs_without_rho']} | {row['items']} | {row['lost']} | "
                     f"{_cell(row['rho'])} | {ci} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.report.error_signal", description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+", type=Path, help="folders of routed run records (searched below)")
    parser.add_argument("--experiment", help="only records of this tracking experiment")
    parser.add_argument("--workload", help="only runs of this routed workload (tag `workload`)")
    parser.add_argument("--random", action="store_true", help="keep random-weight runs (plumbing only)")
    parser.add_argument("--min-runs", type=int, default=MIN_RUNS, help="runs a headline ρ needs")
    parser.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    runs, skipped = read_runs(args.directories, args.experiment, args.workload, args.random)
    result = analyse(runs, args.min_runs, args.n_boot, args.seed)
    print(table(result, skipped))
    if args.json is not None:
        listed = [{k: r[k] for k in ("name", "record", "loss_points", "signals")} for r in runs]
        args.json.write_text(json.dumps(result | {"skipped": skipped, "runs": listed}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
