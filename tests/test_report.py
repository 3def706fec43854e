"""src/report/: every marked BENCHMARKS.md and README.md table equals its rebuild from the committed records in
results/, rows and labels come out of records as the tables need, and results/ holds only small records (never
weights)."""

import json
import shutil
from pathlib import Path

import pytest

from src.records import read_record
from src.report import benchmarks
from src.report.quality_tables import correlation, quality
from src.report.routed_tables import routed_label
from src.report.rows import record_rows
from src.tracking import JsonRecorder, flatten

ROOT = Path(__file__).resolve().parents[1]
WEIGHT_SUFFIXES = {".safetensors", ".pt", ".pth", ".bin", ".gguf", ".npy", ".npz", ".ckpt"}


def test_benchmarks_tables_equal_their_rebuild():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert {name for name, table in benchmarks.TABLES.items() if table.page == "BENCHMARKS.md"} == set(
        benchmarks.marked(text)
    )
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
        assert path.name != "items.json", f"{path}: committed items are kept packed (python -m src.tracking pack DIR)"
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
    transfer (it would pair with pure transfer as its own baseline), and a 100-shot history and a CPU run say so."""
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
    recompute = base | {"params.policy.levers.recompute": "0.25", "params.policy.levers.recompute_rule": "turn"}
    assert routed_label(recompute | {"params.policy.levers.progressive": "1.0"}).endswith("recompute=0.25, rule=turn")
    assert routed_label(recompute | {"params.policy.levers.progressive": "0.5"}).endswith("rule=turn, progressive=0.5")
    assert routed_label(base | {"params.pair.device": "cpu"}).startswith("passage (CPU) |")  # never read as a GPU row
    assert routed_label(base | {"params.pair.device": "cuda"}).startswith("passage |")


OLD_RECORDS = {  # committed records made before the policy moved to conf/policy (2026-12-05) → that policy today
    "routed2-h200-2026-12-03/qwen25coder_0p5b_to_1p5b_routed_passage_local_attn_repair_map_valid-ba3e6e8a": (
        "passage", ("policy.levers.native_sink=4", "policy.levers.recompute=0.25"),
        "native_sink=4, recompute=0.25, rule=deviation",
    ),
    "routed4-h200-2026-12-04/qwen25coder_0p5b_to_1p5b_routed_fewshot_local_attn_repair_auto-86b68461": (
        "fewshot", ("policy.mode=auto",), "policy auto"
    ),
}  # fmt: skip


@pytest.mark.parametrize("old", sorted(OLD_RECORDS), ids=lambda old: old.split("/")[0])
def test_old_and_new_records_name_the_policy_alike(old, tmp_path):
    """A record made before 2026-12-05 names the policy `eval.levers.*`, `workload.policy`,
    `workload.max_length_factor`, `workload.guard_max_abs`; read_record gives it under today's keys (`policy.*`,
    src/records.py `current_params`), a new record's params pass unchanged, and the same policy reads (and labels)
    alike in both."""
    from hydra import compose, initialize_config_dir

    workload, overrides, label = OLD_RECORDS[old]
    path = ROOT / "results" / old / "record.json"
    committed = json.loads(path.read_text())["params"]
    assert not any(key.startswith("policy.") for key in committed)  # the record as it was written
    old_params = read_record(path)["params"]
    assert len(old_params) == len(committed)
    moved = ("eval.levers.", "workload.policy", "workload.max_length_factor", "workload.guard_max_abs")
    assert not any(key.startswith(moved) for key in old_params)
    policy = {key: value for key, value in old_params.items() if key.startswith("policy.")}
    fields = {"mode", "levers", "max_length_factor", "guard_max_abs"}
    assert len(policy) == 9 and {key.split(".")[1] for key in policy} == fields  # mode, 6 levers, 2 guards
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("run", overrides=["+experiment=routed", f"+workload={workload}", *overrides,
                                        "tracking.backend=json", f"tracking.json_dir={tmp_path}"])  # fmt: skip
    tags = {"job": "routed", "workload": workload, "direction": "qwen25coder_0.5b_to_1.5b", "split": "test"}
    JsonRecorder(cfg, "new", tags).close("FINISHED")
    (new_path,) = tmp_path.glob("*/record.json")
    new_params = read_record(new_path)["params"]
    assert new_params == flatten(cfg)  # today's keys pass unchanged
    assert {key: new_params[key] for key in policy} == policy  # the same policy, the same keys and values
    (old_row,) = [row for row in record_rows(path.parent.parent) if row["record"] == str(path)]
    (new_row,) = record_rows(tmp_path)
    assert routed_label(old_row).split(" | ")[2] == routed_label(new_row).split(" | ")[2] == label


def test_the_decision_table_judges_as_the_gate_groups(tmp_path):
    """One row per workload × direction × operating point, judged from each record's items: the latest test run of an
    unregistered point is shown (UNREGISTERED), a run on other items never shadows a point with test runs, and a run
    on the engine is a row of its own."""
    from src.report.routed_tables import decision
    from src.report.rows import record_rows
    from tests.gate_records import REAL, run, task_rows, write_record

    def planted(speedup: float, **tags):
        items = task_rows("arc_easy", 40, speedup=speedup) + task_rows("boolq", 40, speedup=speedup)
        write_record(tmp_path, run(items, tags=REAL | tags))

    for speedup, tags in ((1.5, {}), (2.5, {}), (9.0, {"split": "valid"}), (7.0, {"engine": "graph"})):
        planted(speedup, **tags)
    lines = decision(record_rows(tmp_path)).splitlines()[2:]
    assert len(lines) == 2, lines
    hf, graph = sorted(lines, key=lambda line: "engine graph" in line)
    assert "2.50× [" in hf and "1.50×" not in hf and "9.00×" not in hf  # the latest test run, not validation items
    assert "| latest of 2 |" in hf and hf.endswith("| UNREGISTERED (no plan entry; criteria MISSING) |")
    assert "engine graph" in graph and "6.99× [" in graph  # 70 ms / ≈ 10.03 ms


def test_readme_tables_equal_their_rebuild_and_belong_to_it():
    """README.md holds the front-door tables, generated like BENCHMARKS.md's, and only those."""
    text = benchmarks.README.read_text()
    readme = {name for name, table in benchmarks.TABLES.items() if table.page == "README.md"}
    assert readme == {"headline", "decision_brief"} == set(benchmarks.marked(text))
    assert benchmarks.stale(text, page=benchmarks.README) == []
    with pytest.raises(ValueError, match=r"without a `<!-- table: NAME -->` marker in README.md: \['decision_brief'"):
        benchmarks.rebuild("no markers\n", page=benchmarks.README)
    bench = benchmarks.BENCHMARKS.read_text()
    with pytest.raises(ValueError, match="BENCHMARKS.md marks tables of other pages: {'headline': 'README.md'}"):
        benchmarks.rebuild(bench + "<!-- table: headline -->\n<!-- /table -->\n")


def test_an_edited_number_in_the_readme_is_caught():
    import re

    text = benchmarks.README.read_text()
    table = benchmarks.marked(text)["headline"]
    speedup = re.search(r"(\d)\.\d\d× \[", table)
    edited = table.replace(speedup.group(0), str((int(speedup.group(1)) + 1) % 10) + speedup.group(0)[1:], 1)
    assert edited != table
    assert benchmarks.stale(text.replace(table, edited), page=benchmarks.README) == ["headline"]


def test_headline_numbers_are_the_benchmarks_tables_numbers():
    """A front-door figure is the same cell, from the same record, as in BENCHMARKS.md's tables; a row whose run is
    gone is an error, never an empty cell."""
    from src.report.headline import _pick

    headline = benchmarks.build("headline")
    brief = benchmarks.build("decision_brief").splitlines()
    (bf16,) = [line for line in brief if "| ≤ 8192 tokens, bf16, 200 shots, pure transfer |" in line]
    loss = bf16.split(" | ")[7].removeprefix("UNDERPOWERED ")  # the 120-item 200-shot run: the gate's mean loss
    assert f"| {loss} pt, UNDERPOWERED |" in headline
    paired = benchmarks.build("routed_levers_paired")
    gain = next(line for line in paired.splitlines() if "recompute=0.4" in line and "pure transfer" in line)
    assert f"{gain.split(' | ')[-1].rstrip(' |')} pt up" in headline
    with pytest.raises(ValueError, match="no routed record labelled 'passage | x'"):
        _pick([], "passage | x")


def _vllm_bench(repeats: int, routed_high: float | None = 0.5) -> dict:
    """A scripts/bench_vllm_ttft.py record of one length: each path at its own constant time, so a column read from
    the wrong path shows."""
    at = lambda ms: [ms] * repeats  # noqa: E731
    row = {"tokens": 1024, "reprefill_ms": at(20.0), "hit_ms": at(10.0), "map_ms": at(40.0), "export_ms": at(5.0)}
    row["median_ms"] = {"reprefill": 20.0, "hit": 10.0, "map": 40.0, "routed": 45.0}
    row["speedup"] = {"routed": [0.44, 0.4, routed_high], "hit": [2.0, 1.9, 2.1]}
    machine = {"device": "NVIDIA X1", "torch": "2.0", "vllm": "0.1", "python": "3.12", "date": "2026-01-02"}
    return {"bench": "vllm_ttft", "pair": "/x/conf/pair/p_random.yaml", "weights": "random", "machine": machine,
            "turn": 16, "rows": [row]}  # fmt: skip


def test_the_vllm_table_reads_every_path_of_each_length_and_names_what_the_record_lacks():
    from src.report.vllm_table import BenchRun, vllm_ttft

    runs = {"b/r.json": BenchRun("file, on disk", "bf16", "abc1234"), "b/s.json": BenchRun("file, tmpfs", "bf16", "c")}
    table = vllm_ttft([], ("b/r.json", _vllm_bench(7)), ("b/s.json", _vllm_bench(3, None)), runs=runs)
    header, *_ = table.splitlines()
    for cell in ("p_random", "random weights", "bf16", "new turn 16", "7 repeats", "transport: file, on disk",
                 "2026-01-02", "code abc1234", "vllm 0.1", "NVIDIA X1", "`results/b/r.json`"):  # fmt: skip
        assert cell in header, cell
    rows = [line for line in table.splitlines() if line.startswith("| 1,024 |")]
    # re-prefill / hit / map / export / routed; routed, map alone (20 / 40 every repeat) and hit speedups; routed
    # (map + export, 45) over the hit (10), paired per repeat
    assert rows[0] == (
        "| 1,024 | 20.0 / 10.0 / 40.0 / 5.0 / 45.0 | 0.44× [0.40, 0.50] | 0.50× [0.50, 0.50] | 2.00× [1.90, 2.10] "
        "| 4.50× [4.50, 4.50] |"
    )
    assert rows[1] == "| 1,024 | 20.0 / 10.0 / 40.0 / 5.0 / 45.0 | 0.44× | 0.50× | 2.00× [1.90, 2.10] | 4.50× |"  # < 6


def test_the_vllm_headline_says_slower_only_when_every_interval_is_below_one():
    from src.report.vllm_table import BenchRun, vllm_brief

    run = BenchRun("file, on disk", "bf16", "abc1234")
    answer, on = vllm_brief(("b/r.json", _vllm_bench(7)), run)
    assert answer.startswith("slower than re-prefill at every length") and "(file transport)" in answer
    assert on == "random weights of the pair's shapes, bf16, vllm 0.1, X1, 2026-01-02"
    for high in (None, 1.2):
        assert not vllm_brief(("b/r.json", _vllm_bench(7, high)), run)[0].startswith("slower")
    committed = benchmarks.build("vllm_ttft_i").split("\n\n", 3)[3].splitlines()  # the second record: the real pair
    routed = [line.split(" | ")[2] for line in committed if line.startswith(("| 1,024 |", "| 8,192 |"))]
    assert f"{routed[0]} at 1,024 to {routed[1]} at 8,192 tokens" in benchmarks.build("headline")  # the same cells


def test_the_vllm_tables_name_the_mapper_each_record_timed():
    """The bench's random mapper was Head-Local k = 2 in float32 until 2026-12-07 (its records do not say so); later
    records name theirs; a real record names its fitted dtype. The export's cost is a figure only when positive."""
    from src.report.vllm_table import BenchRun, mapper_of, vllm_brief

    old, new, real = _vllm_bench(7), _vllm_bench(7), _vllm_bench(7)
    new["run"] = {"mapper": "random Head-Local k = 24", "compute_dtype": "bfloat16"}
    real["weights"], real["run"] = "real", {"compute_dtype": "bfloat16"}
    assert mapper_of(old) == "random Head-Local k = 2, float32 coefficients"
    assert mapper_of(new) == "random Head-Local k = 24, bfloat16 coefficients"
    assert mapper_of(real) == "the fitted mapper, bfloat16 coefficients"
    assert "mapper: random Head-Local k = 2, float32" in benchmarks.build("vllm_ttft_f")  # the ninth lease's records
    run = BenchRun("device", "bf16", "abc1234")
    assert "the sender's export alone 5.0 ms" in vllm_brief(("b/r.json", old), run)[0]
    old["rows"][0]["export_ms"] = [-0.5] * 7
    assert "export alone within its request's noise (median -0.5 ms)" in vllm_brief(("b/r.json", old), run)[0]


def test_a_run_set_timed_beside_other_jobs_shows_no_latency(tmp_path, monkeypatch):
    """Table.shared_gpu: the routed rows of a run set measured beside other GPU jobs (frontier3-par) keep their quality
    and prefill, and withhold TTFT, speedup and the gate's verdict (which reads them); the quiet run set's stay."""
    source = ROOT / "results" / benchmarks.FRONTIER3
    quiet = shared = sorted(source.glob("*/record.json"))[0].parent  # the same run in both sets
    for name, run in (("quiet", quiet), ("shared", shared)):
        shutil.copytree(run, tmp_path / name / run.name)
    table = benchmarks.Table(("quiet", "shared"), benchmarks.routed, shared_gpu=("shared",))
    monkeypatch.setitem(benchmarks.TABLES, "probe", table)
    first, second = benchmarks.build("probe", tmp_path).splitlines()[2:]
    assert "shared GPU" not in first and first.count("shared GPU") == 0
    assert second.count("shared GPU") == 4  # p50s, p95s, speedup, gate
    same = lambda line: [c for i, c in enumerate(line.split("|")) if i in (1, 2, 3, 4, 5, 6, 7, 11, 12, 13)]
    assert same(first) == same(second)  # quality, prefill, handoffs, rollback as the quiet row's
