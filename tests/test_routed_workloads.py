"""The routed workloads' registry (src/routed_workloads.py WORKLOADS): each workload named by a conf/workload file
runs end to end through `routed(cfg)` on the tiny random pair from its one entry — fitting the reverse mapper exactly
when its conversation comes back to the source, scoring switch counts apart for switches, and diagnosing fidelity
on the histories it mapped and the receiver's read error of each item (none for multiturn)."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import src.pipeline
import src.routed
from src.routed_workloads import WORKLOADS, examples

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared/data"
SMALL = {  # the fewest items that exercise each workload (a new workload runs at workload.limit=2 unless listed)
    "fewshot": ["workload.tasks=[arc_easy]", "workload.shots={arc_easy: 2}"],
    "fewshot_long": ["workload.tasks=[arc_easy]", "workload.shots={arc_easy: [1, 3]}"],
    "passage": ["workload.tasks=[lambada]"],
    "switches": ["workload.tasks=[lambada]", "workload.switch_counts=[1,2]"],
    "multiturn": ["workload.tasks=[arc_easy]", "workload.turns=3", "workload.limit=3"],
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine (conftest.one_thread)."""


def configured(workload: str, tmp_path: Path):
    overrides = [
        "+experiment=routed", f"+workload={workload}", "workload.limit=2", "workload.rollback_items=1",
        "workload.rollback_tokens=2", "budget.sequences=8", "budget.seq_len=64", f"paths.data={DATA}",
        "tracking.backend=json", f"tracking.json_dir={tmp_path / 'records'}", "eval.diagnose.fidelity=true",
        "eval.diagnose.prompts_per_task=1", f"eval.diagnose.read_error={workload != 'multiturn'}",
        *SMALL.get(workload, []),
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("run", overrides=overrides)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_each_workload_runs_from_its_registry_entry(workload, tmp_path, monkeypatch):
    if not (DATA / "eval").is_dir():
        pytest.skip("shared data not found")
    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(src.pipeline, "_MEMO", {})  # this test's pair and traces stay out of the process's memo
    built = []
    build_mapper = src.routed.build_mapper
    monkeypatch.setattr(
        src.routed, "build_mapper", lambda cfg, pair, *rest: built.append(pair) or build_mapper(cfg, pair, *rest)
    )
    src.routed.routed(configured(workload, tmp_path))
    (path,) = (tmp_path / "records").glob("*/record.json")
    record = json.loads(path.read_text())
    metrics = {m["key"] for m in record["metrics"]}
    assert record["status"] == "FINISHED" and record["tags"]["workload"] == workload
    back = WORKLOADS[workload].reverse
    assert len(built) == (2 if back else 1)  # the target → source mapper only when the conversation comes back
    assert any(key.startswith("handoffs.target_to_source.") for key in metrics) == back  # … and exactly then
    assert ("switches.s2.mean.acc" in metrics) == (workload == "switches")
    assert ("fidelity.attention_output_cosine" in metrics) == (workload != "multiturn")
    assert ("read_error.mean" in metrics) == (workload != "multiturn")  # multiturn refuses it (test_routed.py)
    assert {"task.mean.acc", "rollback_verified", "handoff_frequency"} <= metrics


def test_examples_come_from_a_workload_that_builds_its_own():
    with pytest.raises(
        ValueError,
        match=r"workload 'multiturn' has no examples of its own: one of \['fewshot', 'fewshot_long', 'passage'\]",
    ):
        examples(None, "multiturn")
    with pytest.raises(ValueError, match="workload 'nameless' has no examples"):
        examples(None, "nameless")
