"""The record-reading scripts whose output BENCHMARKS.md quotes (scripts/items_needed.py, scripts/ttft_drift.py) print
those figures from the committed records in results/ — run as a reader would."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BF16 = REPO / "results/routed4-h200-2026-12-04"


def script(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_items_needed_prints_the_quoted_plan():
    run = next(BF16.glob("*map-0af3e66c"))
    out = script("items_needed.py", str(run))
    assert "arc_challenge: 120 items, 7.5% flip, ≈ 726 items for a ±2 pt CI" in out
    assert "arc_easy: 120 items, 6.7% flip, ≈ 635 items for a ±2 pt CI" in out


def test_ttft_drift_shows_the_baseline_timed_apart_from_the_same_work():
    auto, mapped = next(BF16.glob("*auto-86b68461")), next(BF16.glob("*map-0af3e66c"))
    out = script("ttft_drift.py", str(auto), str(mapped), "--blocks", "4")
    assert "speedup (median paired) 1.80×; same work (re-prefill / routed where both re-prefilled) 1.82× on 175" in out
    assert "speedup (median paired) 1.18×; same work (re-prefill / routed where both re-prefilled) —" in out
    assert out.count("turns ") == 8  # four blocks per run
    assert "auto estimates: map 60–2,257 ms; re-prefill 69–86 ms" in out
    assert "199 s, 0.83 s per scored turn (loads, fit, replay included): 1.66× the 0.50 s" in out
    assert "turn 0 (6,214 tokens):   31.0 /   47.5 /   27.8" in out  # the clean first turns BENCHMARKS quotes
