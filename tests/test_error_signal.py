"""The error-signal analysis (src/report/error_signal.py) on synthetic routed records: a planted monotone relation
between a run's read error and its loss is recovered (ρ ≈ 1, CI above 0) and noise gives a CI covering 0, at the run
and at the item level; fewer runs than the minimum are reported as such, never hidden; ranks share ties."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from src.records import pack
from src.report.error_signal import average_ranks, main, spearman, spearman_ci

RIGHT, WRONG = [[-1.0, 0.0], [-2.0, 0.0]], [[-2.0, 0.0], [-1.0, 0.0]]  # label 0 wins / loses


def item(index: int, error: float, lost: bool) -> dict:
    """A boolq item the native receiver answers right; the routed one too unless `lost`."""
    return {
        "task": "boolq", "index": index, "label": 0, "lengths": [1, 1], "history_tokens": 50, "turn_tokens": 5,
        "scores": {"native_target": RIGHT, "routed": WRONG if lost else RIGHT, "native_source": WRONG},
        "nll": {"native_target": 1.0, "routed": 1.0 + error, "native_source": 2.0},
        "handoff": None, "read_error": {"mean": error, "max": 2 * error},
    }  # fmt: skip


def write_run(folder: Path, name: str, loss: float, error: float, items: list[dict]) -> None:
    (folder / name / "artifacts/routed").mkdir(parents=True)
    metrics = {"task.mean.loss_points": loss, "read_error.mean": error, "read_error.max": 2 * error}
    record = {
        "name": name, "experiment": "error_signal", "status": "FINISHED", "params": {},
        "tags": {"job": "routed", "weights": "real", "workload": "passage"},
        "metrics": [{"key": k, "value": v, "step": None} for k, v in metrics.items()],
    }  # fmt: skip
    (folder / name / "record.json").write_text(json.dumps(record))
    (folder / name / "artifacts/routed/items.json").write_text(json.dumps({"items": items}))


def records(folder: Path, runs: int, planted: bool, seed: int = 0) -> Path:
    """`runs` runs of 60 items; planted: a run's loss rises with its read error, and an item is lost exactly when
    its read error is high; else loss and lost items are drawn apart from the errors."""
    rng = np.random.default_rng(seed)
    for n in range(runs):
        errors = rng.uniform(0, 1, 60)
        lost = errors > 0.7 if planted else rng.uniform(0, 1, 60) > 0.7
        error = float(errors.mean()) + n / runs
        loss = 30 * error**2 + rng.normal(0, 0.5) if planted else rng.normal(10, 5)
        rows = [item(i, e, b) for i, (e, b) in enumerate(zip(errors, lost, strict=True))]
        write_run(folder, f"run{n:02d}", loss, error, rows)
    return folder


def analysed(folder: Path, capsys, *flags: str) -> tuple[dict, str]:
    assert main([str(folder), "--json", str(folder / "out.json"), "--n-boot", "500", *flags]) == 0
    return json.loads((folder / "out.json").read_text()), capsys.readouterr().out


def test_ranks_share_ties_and_rank_correlation_reads_order_only():
    assert average_ranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    assert average_ranks(np.array([[1.0, 1.0, 0.0], [0.0, 5.0, 9.0]])).tolist() == [[2.5, 2.5, 1.0], [1.0, 2.0, 3.0]]
    x = np.array([0.1, 0.5, 0.2, 0.9, 0.4])
    assert spearman(x, np.exp(x)) == pytest.approx(1.0) and spearman(x, -(x**3)) == pytest.approx(-1.0)
    assert math.isnan(spearman(x, np.ones(5)))
    assert spearman(np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 3.0, 2.0, 4.0])) == pytest.approx(0.9486832980505138)
    assert math.isnan(spearman_ci(x[:2], x[:2], 10, 0).estimate)  # two runs: no ρ


def test_a_planted_monotone_relation_is_recovered(tmp_path, capsys):
    result, out = analysed(records(tmp_path, 24, planted=True), capsys)
    run = result["run_level"]["read_error"]
    assert run["runs"] == 24 and run["enough_runs"] and run["rho"] > 0.95 and run["low"] > 0.5
    assert "| read_error | 24 | 24 | +1.00 |" in out and "more error, more loss (CI above 0)" in out
    items = result["item_level"]["read_error"]
    assert items["runs"] == 24 and items["items"] == 24 * 60 and items["rho"] > 0.6 and items["low"] > 0.5
    assert result["run_level"]["fidelity_1-r2_k"]["runs"] == 0  # a signal the records lack: no runs, no ρ


def test_noise_gives_a_ci_that_covers_zero(tmp_path, capsys):
    result, out = analysed(records(tmp_path, 24, planted=False), capsys)
    run, items = result["run_level"]["read_error"], result["item_level"]["read_error"]
    assert run["runs"] == 24 and run["low"] < 0 < run["high"] and items["low"] < 0 < items["high"]
    assert "no signal shown (CI covers 0)" in out


def test_fewer_runs_than_the_minimum_are_reported_not_hidden(tmp_path, capsys):
    result, out = analysed(records(tmp_path, 8, planted=True), capsys)
    run = result["run_level"]["read_error"]
    assert run["runs"] == 8 and not run["enough_runs"] and math.isfinite(run["low"]) and run["rho"] > 0.9
    assert "n < 20: exploratory, not a headline" in out and "fewer than the 20 the issue asks for" in out
    assert "more error, more loss" not in out
    result, out = analysed(tmp_path, capsys, "--min-runs", "5")
    assert result["run_level"]["read_error"]["enough_runs"] and "fewer than" not in out
    assert len(pack([tmp_path])) == 8  # items packed, as committed records keep them: read alike
    assert analysed(tmp_path, capsys, "--min-runs", "5") == (result, out)
    result, out = analysed(tmp_path, capsys, "--experiment", "other")
    assert result["run_level"]["read_error"]["runs"] == 0 and "8 other experiment" in out
