"""src/report/: every marked BENCHMARKS.md table equals its rebuild from the committed records in results/, rows
and labels come out of records as the tables need, and results/ holds only small records (never weights)."""

import json
from pathlib import Path

import pytest

from src.report import benchmarks
from src.report.quality_tables import correlation, quality
from src.report.routed_tables import routed_label
from src.report.rows import record_rows

ROOT = Path(__file__).resolve().parents[1]
WEIGHT_SUFFIXES = {".safetensors", ".pt", ".pth", ".bin", ".gguf", ".npy", ".npz", ".ckpt"}


def test_benchmarks_tables_equal_their_rebuild():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert set(benchmarks.TABLES) <= set(benchmarks.marked(text))
    assert benchmarks.stale(text) == []


def test_an_edited_number_is_caught():
    text = (ROOT / "BENCHMARKS.md").read_text()
    table = benchmarks.marked(text)["quickstart"]
    edited = table.replace("| held-out R² K / V | 0.", "| held-out R² K / V | 1.", 1)
    assert edited != table
    assert benchmarks.stale(text.replace(table, edited)) == ["quickstart"]


def test_results_hold_small_records_and_no_weights():
    files = [path for path in (ROOT / "results").rglob("*") if path.is_file()]
    assert any(path.name == "record.json" for path in files)
    for path in files:
        assert path.suffix not in WEIGHT_SUFFIXES and path.stat().st_size <= 1 << 20, path
        if path.name == "record.json":
            record = json.loads(path.read_text())
            assert {"name", "experiment", "status", "params", "tags", "metrics"} <= set(record), path
            assert record["status"] in ("FINISHED", "FAILED", "KILLED"), path


def _record(directory: Path, name: str, status: str, metrics: dict, step: int | None = None, **tags) -> None:
    folder = directory / name
    folder.mkdir(parents=True)
    record = {
        "name": name,
        "experiment": "x",
        "status": status,
        "start_time": 1796306488345 + len(list(directory.iterdir())),
        "end_time": None,
        "params": {"fit.k": "4", "budget.corpus": "gutenberg", "eval.nll.prefix_len": "512"},
        "tags": {"job": "fit_eval", "direction": "a_to_b", "method": "local"} | tags,
        "metrics": [{"key": k, "value": v, "step": step} for k, v in metrics.items()],
    }
    (folder / "record.json").write_text(json.dumps(record))


def test_rows_skip_unfinished_records_and_keep_steps(tmp_path):
    _record(tmp_path, "done", "FINISHED", {"nll_transfer": 5.0, "prefill_fraction": 0.25})
    _record(tmp_path, "crashed", "FAILED", {"nll_transfer": 9.0})
    _record(tmp_path, "ttft", "FINISHED", {"ttft_ms_p50": 3.0}, step=16)
    rows = record_rows(tmp_path)
    assert [row["name"] for row in rows] == ["done", "ttft"]
    assert rows[1]["series.ttft_ms_p50"] == {16: 3.0} and rows[1]["metrics.ttft_ms_p50"] == 3.0
    assert "| a_to_b local k=4 gutenberg | 512 | 0.250 |" in quality(rows[:1])


def test_rebuild_replaces_only_between_markers(tmp_path, monkeypatch):
    _record(tmp_path / "set", "only", "FINISHED", {"nll_transfer": 5.0})
    monkeypatch.setattr(
        benchmarks, "TABLES", {"demo": benchmarks.Table(("set",), lambda rows: f"| runs |\n|---|\n| {len(rows)} |")}
    )
    text = "before\n<!-- table: demo -->\n| old |\n<!-- /table -->\nafter\n"
    assert (
        benchmarks.rebuild(text, tmp_path)
        == "before\n<!-- table: demo -->\n| runs |\n|---|\n| 1 |\n<!-- /table -->\nafter\n"
    )
    assert benchmarks.stale(text, tmp_path) == ["demo"]
    with pytest.raises(ValueError, match="without a `<!-- table: NAME -->` marker"):
        benchmarks.rebuild("no markers\n", tmp_path)
    with pytest.raises(ValueError, match="no table 'nameless'"):
        benchmarks.rebuild(text + "<!-- table: nameless -->\n<!-- /table -->\n", tmp_path)
    monkeypatch.setitem(benchmarks.TABLES, "demo", benchmarks.Table(("empty",), lambda rows: ""))
    with pytest.raises(ValueError, match="none holds a FINISHED record.json"):
        benchmarks.rebuild(text, tmp_path)


def test_correlation_over_the_runs_that_logged_both(tmp_path):
    for i, (cosine, retention) in enumerate([(0.9, 0.8), (0.7, 0.6), (0.8, 0.9), (0.5, 0.4)]):
        _record(tmp_path, f"run{i}", "FINISHED", {"attention_output_cosine": cosine, "task.mean.retention": retention})
    _record(tmp_path, "no_cosine", "FINISHED", {"task.mean.retention": 0.1})
    rows = record_rows(tmp_path)
    line = correlation(rows, "attention_output_cosine", "task.mean.retention")
    assert (
        line.startswith("attention_output_cosine vs task.mean.retention: Spearman ρ +0.80 [") and "over 4 runs" in line
    )
    assert "at least 3 are needed" in correlation(rows[:2], "attention_output_cosine", "task.mean.retention")


def test_routed_labels_name_every_mapper_change_and_long_histories():
    """A run whose mapper differs (V fitted in attention space, target-written calibration) is never labelled pure
    transfer (it would pair with pure transfer as its own baseline), and a 100-shot history says so."""
    base = {"tags.workload": "passage", "tags.direction": "qwen25coder_0.5b_to_1.5b", "params.fit.v_space": "token"}
    assert routed_label(base) == "passage | 0.5b → 1.5b | pure transfer"
    vattn = base | {"params.fit.v_space": "attention"}
    assert routed_label(vattn).endswith("| V fit in attention space")
    greedy = base | {"params.budget.continuation": "0.5"}
    assert routed_label(greedy).endswith("| calibration 50% target-greedy")
    long = base | {"tags.workload": "fewshot", "params.workload.shots.arc_easy": "100"}
    assert routed_label(long).startswith("fewshot (100 shots) |")
    short = long | {"params.workload.shots.arc_easy": "25"}
    assert routed_label(short).startswith("fewshot |")
    recompute = base | {"params.eval.levers.recompute": "0.25", "params.eval.levers.recompute_rule": "turn"}
    assert routed_label(recompute | {"params.eval.levers.progressive": "1.0"}).endswith("recompute=0.25, rule=turn")
    assert routed_label(recompute | {"params.eval.levers.progressive": "0.5"}).endswith("rule=turn, progressive=0.5")


def test_the_decision_table_judges_as_the_gate_groups(tmp_path):
    """One row per workload × direction × operating point: the latest test run of a group wins, a run on other items
    never shadows a group that has test runs, and a run on the engine is a row of its own."""
    from src.report.routed_tables import decision

    def row(start: int, speedup: float, **tags) -> dict:
        tags = {"job": "routed", "workload": "fewshot", "direction": "a_to_b", "split": "test"} | tags
        metrics = {"ttft_speedup": speedup, "ttft_speedup_low": speedup, "ttft_speedup_high": speedup}
        items = tmp_path / str(start) / "artifacts/routed/items.json"
        items.parent.mkdir(parents=True)
        items.write_text(json.dumps({"items": []}))
        return (
            {"start_time": start, "record": str(tmp_path / str(start) / "record.json")}
            | {f"tags.{k}": v for k, v in tags.items()}
            | {f"metrics.{k}": v for k, v in metrics.items()}
        )

    rows = [row(1, 1.5), row(2, 2.5), row(3, 9.0, split="valid"), row(4, 7.0, engine="graph")]
    lines = decision(rows).splitlines()[2:]
    assert len(lines) == 2, lines
    hf, graph = sorted(lines, key=lambda line: "engine graph" in line)
    assert "2.50×" in hf and "1.50×" not in hf and "9.00×" not in hf  # the latest test run, not validation items
    assert "engine graph" in graph and "7.00×" in graph
