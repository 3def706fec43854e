"""The record-reading scripts whose output BENCHMARKS.md quotes (scripts/items_needed.py, scripts/ttft_drift.py) print
those figures from the committed records in results/ — run as a reader would —, and a truncated or incomplete record
is named by every record reader (the scripts, tables.py, src/choose.py, `src.tracking import`), never a traceback."""

import gzip
import importlib.util
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from src.records import ITEMS

REPO = Path(__file__).resolve().parents[1]
BF16 = REPO / "results/routed4-h200-2026-12-04"


def output(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_items_needed_prints_the_non_inferiority_plan():
    """The gate's reading of the 120-item 200-shot run: 9 and 8 of 120 items differ; at a true loss of 0 and that
    discordance a PASS at 80 % power needs ≈ 6,000 items per task — the observed loss (+0.83, −3.33) plays no part."""
    run = next(BF16.glob("*map-0af3e66c"))
    out = output("items_needed.py", str(run))
    assert (
        "arc_challenge: 120 items, 9 differ, loss +0.83 [-4.75, +6.59] pt vs margin 1: UNDERPOWERED; ≈ 5828 more" in out
    )
    assert "arc_easy: 120 items, 8 differ, loss -3.33 [-9.08, +1.60] pt vs margin 1: UNDERPOWERED; ≈ 5183 more" in out


def test_ttft_drift_shows_the_baseline_timed_apart_from_the_same_work():
    auto, mapped = next(BF16.glob("*auto-86b68461")), next(BF16.glob("*map-0af3e66c"))
    out = output("ttft_drift.py", str(auto), str(mapped), "--blocks", "4")
    same = "same work (baseline re-prefill / the same re-prefill in the routed session)"
    assert f"speedup (median paired) 1.80× [1.77, 1.82]; {same} 1.82× on 175 turns" in out
    assert f"speedup (median paired) 1.18× [1.15, 1.22]; {same} —" in out
    assert out.count("turns ") == 8  # four blocks per run
    assert "auto estimates: map 60–2,257 ms; re-prefill 69–86 ms" in out
    assert "199 s, 0.83 s per scored turn (loads, fit, replay included): 1.66× the 0.50 s" in out
    assert "turn 0 (6,214 tokens):   31.0 /   47.5 /   27.8" in out  # the clean first turns BENCHMARKS quotes
    assert "a length new to its process / seen before: new 98.3 ms (211 turns); seen before 51.2 ms" in out


def test_ttft_drift_ties_the_gate_s_baseline_drift_to_lengths_new_to_each_shard():
    """The gate's joined record (8 shard processes): the re-prefill is ≈ 2× on a length its shard's process had not run
    (warm-up included), and the routed and hit paths spike only on a turn whose graph bucket is captured first."""
    gate = next((REPO / "results/gate-h100-2026-12-06").glob("*shards8*"))
    out = output("ttft_drift.py", str(gate))
    assert "seen before: new 84.9 ms (766 turns); seen before 40.2 ms (34 turns)" in out
    assert "bucket is new / seen before: new 53.5 / 64.2 ms (21 turns); seen before 8.0 / 3.9 ms (779 turns)" in out


def test_gate_coverage_reads_the_discordance_of_the_committed_items():
    """The items gate_coverage.py read when it wrote its record (coverage.json: the share of items that differ per
    task of every routed test-item record) are read alike from the records as committed (packed: items.json.gz)."""
    kept = json.loads((REPO / "results/gate-coverage-cpu-2026-12-06/coverage.json").read_text())["observed_discordance"]
    found = _module("gate_coverage").observed_discordance(REPO / "results")
    assert not Counter(kept) - Counter(found)  # a later test-item record may add shares, never take one away


# --- damaged records: every reader names the file and what is missing --------------------------------------------


@pytest.fixture
def damaged(tmp_path) -> dict[str, Path]:
    """Copies of a committed routed record: truncated record.json, record without metrics, its packed items cut short
    (items.json.gz), unpacked and truncated (items.json), and a record that lacks the throughput metric ttft_drift
    reads."""
    source = next(BF16.glob("*map-0af3e66c"))
    found = {}
    for name in ("truncated", "no_metrics", "items_truncated", "items_cut", "no_throughput"):
        found[name] = shutil.copytree(source, tmp_path / name / source.name)
    record = found["truncated"] / "record.json"
    record.write_text(record.read_text()[:500])
    record = found["no_metrics"] / "record.json"
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "metrics"}))
    packed = found["items_truncated"] / f"{ITEMS}.gz"
    (found["items_truncated"] / ITEMS).write_bytes(gzip.decompress(packed.read_bytes())[:1000])
    packed.unlink()
    packed = found["items_cut"] / f"{ITEMS}.gz"
    packed.write_bytes(packed.read_bytes()[:1000])
    record = found["no_throughput"] / "record.json"
    loaded = json.loads(record.read_text())
    loaded["metrics"] = [m for m in loaded["metrics"] if m["key"] != "throughput.routed_items_per_s"]
    record.write_text(json.dumps(loaded))
    return found


def _module(name: str):
    """A script of scripts/ imported as a module (its `main` then runs in this process)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refused(main, argv: list[str], monkeypatch, *names: str) -> None:
    """`main` under these arguments exits with a message naming the file and the key: no traceback."""
    monkeypatch.setattr(sys, "argv", ["reader", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    message = str(exit_info.value.code)
    assert all(name in message for name in names), message


def test_ttft_drift_names_the_damaged_file_and_key(damaged, monkeypatch):
    main = _module("ttft_drift").main
    truncated, no_metrics = damaged["truncated"] / "record.json", damaged["no_metrics"] / "record.json"
    _refused(main, [str(damaged["truncated"])], monkeypatch, f"{truncated}: not valid JSON, truncated")
    _refused(main, [str(damaged["no_metrics"])], monkeypatch, f"{no_metrics}: no 'metrics'")
    items = damaged["items_truncated"] / ITEMS
    _refused(main, [str(damaged["items_truncated"])], monkeypatch, f"{items}: not valid JSON")
    _refused(main, [str(damaged["items_cut"])], monkeypatch, f"{damaged['items_cut'] / ITEMS}.gz: not a valid gzip")
    record = damaged["no_throughput"] / "record.json"
    _refused(main, [str(damaged["no_throughput"])], monkeypatch, f"{record}: no 'throughput.routed_items_per_s'")


def test_items_needed_names_the_damaged_items(damaged, monkeypatch):
    main = _module("items_needed").main
    items = damaged["items_truncated"] / ITEMS
    _refused(main, [str(damaged["items_truncated"])], monkeypatch, f"{items}: not valid JSON")
    _refused(main, [str(damaged["items_cut"])], monkeypatch, f"{damaged['items_cut'] / ITEMS}.gz: not a valid gzip")


@pytest.mark.parametrize(("name", "message"), [("truncated", "not valid JSON"), ("no_metrics", "no 'metrics'")])
def test_tables_names_the_damaged_record(damaged, monkeypatch, name, message):
    main = _module("tables").main
    _refused(main, ["--records", str(damaged[name].parent)], monkeypatch, f"{damaged[name]}/record.json: {message}")


@pytest.mark.parametrize(("name", "message"), [("truncated", "not valid JSON"), ("no_metrics", "no 'metrics'")])
def test_choose_names_the_damaged_record(damaged, monkeypatch, name, message):
    from src.choose import main

    _refused(main, [str(damaged[name].parent)], monkeypatch, f"{damaged[name]}/record.json: {message}")


def test_import_names_the_damaged_record_and_imports_nothing(damaged, tmp_path, monkeypatch):
    """The good record beside the damaged one is not imported either: every record is checked first."""
    from mlflow import MlflowClient

    from src.tracking import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    folder = damaged["no_metrics"].parent
    shutil.copytree(next(BF16.glob("*auto-86b68461")), folder / "good")
    argv = ["import", str(folder), "--uri", uri, "--artifacts", str(tmp_path / "artifacts")]
    _refused(main, argv, monkeypatch, f"{damaged['no_metrics']}/record.json: no 'metrics'")
    assert MlflowClient(uri).search_experiments(filter_string="name = 'routed'") == []


def test_a_record_metric_without_its_step_is_named(tmp_path):
    from src.records import RecordError, read_record

    path = tmp_path / "record.json"
    path.write_text(json.dumps({"name": "x", "params": {}, "tags": {}, "metrics": [{"key": "a", "value": 1.0}]}))
    with pytest.raises(RecordError, match=r"record\.json metrics\[0\]: no 'step'"):
        read_record(path)
    path.write_text("[]")
    with pytest.raises(RecordError, match="holds a JSON list, not a record object"):
        read_record(path)
    path.write_text(json.dumps({"name": "x", "params": ["fit.k"], "tags": {}, "metrics": []}))
    with pytest.raises(RecordError, match="'params' is a list, not a mapping of config keys"):
        read_record(path)  # its keys are renamed to today's names (current_params): a list has none


def test_rerun_agreement_prints_the_gate_re_run_against_its_first_run():
    """The tenth-session lease re-ran three of the upward gate's shards (code 7f7a215, another H100): every routed and
    native-target answer of the 600 items is the first run's; one native-source answer differs, on an exact tie."""
    out = output("rerun_agreement.py", str(REPO / "results/gate-h100-2026-12-07"),
                 str(REPO / "results/gate-h100-2026-12-06b"))  # fmt: skip
    assert "routed: 0 of 600 answers differ (their margins: —); largest |Δ score| 0.072" in out
    assert "native_target: 0 of 600 answers differ" in out
    assert "native_source: 1 of 600 answers differ (their margins: 0);" in out


def _run(root: Path, name: str, scores: list[list[float]], status: str = "FINISHED") -> Path:
    folder = root / name
    (folder / ITEMS).parent.mkdir(parents=True)
    record = {"name": name, "status": status, "params": {}, "tags": {}, "metrics": []}
    (folder / "record.json").write_text(json.dumps(record))
    items = [{"task": "arc_easy", "index": n, "scores": {"routed": [[s, 0.0] for s in row]}}
             for n, row in enumerate(scores)]  # fmt: skip
    (folder / ITEMS).write_text(json.dumps({"items": items}))
    return folder


def test_rerun_agreement_counts_a_changed_answer_and_refuses_other_items(tmp_path):
    spec = importlib.util.spec_from_file_location("rerun_agreement", REPO / "scripts/rerun_agreement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    first, second = tmp_path / "first", tmp_path / "second"
    _run(first, "run-a", [[-1.0, -2.0], [-3.0, -2.5]])
    _run(second, "run-a", [[-1.0, -2.0], [-2.0, -2.5]])  # item 1's answer changes: choice 1 → 0
    _run(first, "run-cut", [[-1.0, -2.0]], status="RUNNING")
    found = module.agreement(first, second)
    assert found["total"]["routed"] == {"items": 2, "differ": 1, "margins": [0.5], "max_abs_score_change": 1.0}
    assert found["not_finished"] == ["run-cut"]
    shutil.rmtree(second / "run-a")
    _run(second, "run-a", [[-3.0, -2.5], [-1.0, -2.0]]).joinpath(ITEMS).write_text(
        json.dumps({"items": [{"task": "arc_easy", "index": n, "scores": {"routed": [[0.0, 0.0]]}} for n in (1, 0)]})
    )
    with pytest.raises(module.RecordError, match="run-a: the two runs hold different items"):
        module.agreement(first, second)
    script = str(REPO / "scripts/rerun_agreement.py")
    done = subprocess.run([sys.executable, script, str(first), str(tmp_path / "none")], capture_output=True, text=True)
    assert done.returncode != 0 and "rerun_agreement: " in done.stderr and "Traceback" not in done.stderr
