"""The lever frontier plot (scripts/frontier.py) over the committed routed records: one panel per direction and
item split, one series per recompute rule, points in prefill order, fewshot and other workloads left out."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scripts_frontier", ROOT / "scripts/frontier.py")
frontier = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(frontier)
RECORDS = [ROOT / "results/routed-h200-2026-12-03", ROOT / "results/routed2-h200-2026-12-03"]


def test_panels_and_series_of_the_committed_passage_runs():
    rows = [row for folder in RECORDS for row in frontier.record_rows(folder)]
    panels = frontier.series(rows, "passage")
    forward, reverse = "qwen25coder_0.5b_to_1.5b", "qwen25coder_1.5b_to_0.5b"
    assert set(panels) == {(forward, "test"), (forward, "valid"), (reverse, "test"), (reverse, "valid")}
    rules = {f"recompute, {rule} rule" for rule in ("deviation", "attention", "recency")}
    assert set(panels[(forward, "valid")]) == rules
    deviation = panels[(forward, "valid")]["recompute, deviation rule"]
    assert [round(p[0], 2) for p in deviation] == sorted(round(p[0], 2) for p in deviation) and len(deviation) == 3
    ((spent, loss, low, high),) = panels[(forward, "test")]["no recompute"]
    assert spent == 0.0 and low < loss == 33.5 < high
    assert len(frontier.plot(panels, "t").axes) == 4
    assert frontier.series(rows, "multiturn") and not frontier.series(rows, "no_such_workload")
