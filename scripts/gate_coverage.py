"""Does the gate's PASS mean what it says at small samples? Paired binary outcomes simulated at true losses of 0, 0.5,
1, 2 and 3 points and n = 20 … 800 items per task, at the share of items that differ (discordance) the committed
records show, each draw judged by the gate's own decision (src/gate_criteria.py `task_status`, and `run_status` over
the tasks of a run) — the rate of PASS at a true loss of the margin (1 point) must stay at or below 2.5 % at every n.

For independent items the gate's decision depends on the counts only (items lost, gained, of n), so each draw's
counts are judged by `task_status`; beside the simulated rate the script prints the exact one (the trinomial summed
over every table through the same decisions), which has no Monte-Carlo error. A spot check builds item rows for some
draws and judges them end to end (`judge_run`), asserting it agrees with the counts. Turns clustered in conversations
(multi-turn: 8 turns each, conversations that differ in how often they disagree) go through `paired` (the design
effect) row by row.

    nice -n 10 python scripts/gate_coverage.py [--draws 200000] [--clustered-draws 3000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.special import gammaln, xlogy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from src.gate_criteria import Paired, judge_run, paired, run_status, task_status, task_verdicts, thresholds  # noqa: E402
from src.gate_evidence import evidence  # noqa: E402
from src.records import items_path, metric_values, read_json, read_record  # noqa: E402

LOSSES = (0.0, 0.5, 1.0, 2.0, 3.0)  # true loss, points
SIZES = (20, 50, 100, 200, 400, 800)  # items per task
DISCORDANCES = (0.03, 0.08, 0.15)  # share of items whose routed and native answers differ
CLUSTERS = (30, 50, 100)  # conversations per task, 8 turns each
CODES = ("PASS", "FAIL", "UNDERPOWERED")


def observed_discordance(results: Path) -> list[float]:
    """The share of items that differ per task of every routed test-item record with real weights in results/."""
    shares = []
    for path in sorted(results.glob("routed*/*/record.json")):
        record = read_record(path)
        tags = record["tags"]
        items = items_path(path.parent)
        if tags.get("split") != "test" or tags.get("weights") != "real" or not items.is_file():
            continue
        run = evidence(record["name"], path.parent.name, 0, metric_values(record, path), record["params"], tags,
                       read_json(items), str(path.parent))  # fmt: skip
        shares += [(c.lost + c.gained) / c.rows for _, c, _ in task_verdicts(run, thresholds())]
    return shares


def decisions(n: int, limits) -> np.ndarray:
    """[n+1, n+1] codes (index into CODES) of the gate's decision on every table of n independent items."""
    table = np.full((n + 1, n + 1), -1, dtype=np.int8)
    for lost in range(n + 1):
        for gained in range(n + 1 - lost):
            table[lost, gained] = CODES.index(task_status(Paired(lost, gained, n, n), limits))
    return table


def cells(loss: float, discordance: float) -> tuple[float, float, float]:
    """(P(lost), P(gained), P(alike)) per item at this true loss (points) and discordance."""
    p_lost, p_gained = (discordance + loss / 100) / 2, (discordance - loss / 100) / 2
    return p_lost, p_gained, 1 - p_lost - p_gained


def exact_rates(table: np.ndarray, n: int, probabilities: tuple[float, float, float]) -> np.ndarray:
    """[3] P(PASS), P(FAIL), P(UNDERPOWERED): the trinomial summed over every table's decision."""
    lost, gained = np.nonzero(table >= 0)
    p_lost, p_gained, p_alike = probabilities
    log_p = gammaln(n + 1) - gammaln(lost + 1) - gammaln(gained + 1) - gammaln(n - lost - gained + 1)
    log_p += xlogy(lost, p_lost) + xlogy(gained, p_gained) + xlogy(n - lost - gained, p_alike)  # 0·log 0 = 0
    return np.bincount(table[lost, gained], weights=np.exp(log_p), minlength=3)


def simulated(table: np.ndarray, n: int, probabilities, draws: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Codes of `draws` simulated tasks at these cell probabilities, and their (lost, gained) counts [draws, 2]."""
    counts = rng.multinomial(n, probabilities, size=draws)[:, :2]
    return table[counts[:, 0], counts[:, 1]], counts


def spot_check(table: np.ndarray, counts: np.ndarray, n: int, limits, runs: int) -> int:
    """Build item rows for `runs` draws (two tasks each), judge them end to end, assert the counts' decision."""
    from tests.gate_records import REAL, run, task_rows

    for first, second in counts[: 2 * runs].reshape(runs, 2, 2):
        items = task_rows("arc_easy", n, *first) + task_rows("boolq", n, *second)
        (quality,) = [v for v in judge_run(run(items, tags=REAL), limits) if v.criterion.startswith("quality")]
        expected = run_status([CODES[table[tuple(first)]], CODES[table[tuple(second)]]])
        assert quality.status == expected, (first, second, quality.measured)
    return runs


def clustered_rates(conversations: int, loss: float, discordance: float, draws: int, limits, rng) -> np.ndarray:
    """[3] rates over `draws` tasks of 8-turn conversations whose discordance varies (Beta, mean `discordance`,
    concentration 2: some conversations disagree often, most rarely), each judged through `paired` (the design
    effect) and `task_status`."""
    turns, found = 8, np.zeros(3)
    units = np.repeat(np.arange(conversations), turns).astype(str).tolist()
    for _ in range(draws):
        share = rng.beta(2 * discordance, 2 * (1 - discordance), conversations)  # [K] per conversation
        p_lost, p_gained = (
            share * (discordance + loss / 100) / (2 * discordance),
            share * (discordance - loss / 100) / (2 * discordance),
        )
        draw = rng.random((conversations, turns))  # [K, 8]
        lost = draw < p_lost[:, None]
        gained = (draw >= p_lost[:, None]) & (draw < (p_lost + p_gained)[:, None])
        native, routed = ~gained.ravel(), ~lost.ravel()  # lost: native right, routed wrong; gained: the reverse
        found[CODES.index(task_status(paired(native, routed, units), limits))] += 1
    return found / draws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=200_000, help="simulated tasks per (n, loss, discordance)")
    parser.add_argument("--clustered-draws", type=int, default=3_000, help="per (conversations, loss)")
    parser.add_argument("--spot-runs", type=int, default=20, help="runs judged end to end from item rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=ROOT / "results/gate-coverage-cpu-2026-12-06/coverage.json")
    args = parser.parse_args()
    began, rng, limits = time.perf_counter(), np.random.default_rng(args.seed), thresholds()
    shares = observed_discordance(ROOT / "results")
    print(f"discordance in the committed test-item records: {len(shares)} tasks, median {np.median(shares):.1%}, "
          f"range {min(shares):.1%} – {max(shares):.1%}; simulated at {', '.join(f'{q:.0%}' for q in DISCORDANCES)}")  # fmt: skip
    out = {"margin_points": limits.max_loss_points, "min_task_units": limits.min_task_units, "draws": args.draws,
           "seed": args.seed, "observed_discordance": sorted(shares), "independent": [], "clustered": []}  # fmt: skip
    spot = 0
    for n in SIZES:
        table = decisions(n, limits)
        for discordance in DISCORDANCES:
            for loss in LOSSES:
                probabilities = cells(loss, discordance)
                exact = exact_rates(table, n, probabilities)
                codes, counts = simulated(table, n, probabilities, args.draws, rng)
                rates = np.bincount(codes, minlength=3) / args.draws
                pair = run_status_rates(codes, table, n, discordance, args.draws, rng)
                if loss == limits.max_loss_points and n == 100 and discordance == 0.08:
                    spot += spot_check(table, counts, n, limits, args.spot_runs)
                out["independent"].append(
                    {
                        "n": n,
                        "discordance": discordance,
                        "loss_points": loss,
                        "simulated": dict(zip(CODES, rates, strict=True)),
                        "exact": dict(zip(CODES, exact, strict=True)),
                        "two_task_run_pass": pair,
                    }  # fmt: skip
                )
    for conversations in CLUSTERS:
        for loss in LOSSES:
            rates = clustered_rates(conversations, loss, 0.08, args.clustered_draws, limits, rng)
            out["clustered"].append({"conversations": conversations, "turns": 8, "discordance": 0.08,
                                     "loss_points": loss, "simulated": dict(zip(CODES, rates, strict=True))})  # fmt: skip
    out["spot_checked_runs"] = spot
    out["seconds"] = round(time.perf_counter() - began, 1)
    print(table_text(out))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{spot} runs judged end to end from item rows agree with their counts; {out['seconds']} s; {args.json}")


def run_status_rates(codes: np.ndarray, table: np.ndarray, n: int, discordance: float, draws: int, rng) -> float:
    """P(PASS) of a two-task run: this task's draws beside a task that loses nothing, over the gate's rule that every
    task must pass (`run_status`)."""
    other, _ = simulated(table, n, cells(0.0, discordance), draws, rng)
    passes = np.array([[run_status([a, b]) == "PASS" for b in CODES] for a in CODES])  # [3, 3]
    return float(passes[codes, other].mean())


def table_text(out: dict) -> str:
    """The coverage as Markdown (also BENCHMARKS § reliability, rebuilt from the JSON by scripts/tables.py)."""
    from src.report.reliability import coverage

    return coverage([], ("coverage.json", out))


if __name__ == "__main__":
    main()
