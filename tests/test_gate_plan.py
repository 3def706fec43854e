"""The gate's decision over many runs (src/gate.py `decide`, src/gate_plan.py): dtype, shots, levers, policy and
engine are each an operating point, a point is judged on the run its plan entry named before it ran — never a later
re-run that passes, never the latest by default — a point without an entry is UNREGISTERED (and says when its run
predates plans), a shard is never judged alone even without its tag; then `check` over an MLflow store, the CLI and the
Hydra `job=gate` exit statuses."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from src.gate import check, decide, summary_table
from src.gate_plan import Plans, load_plans, operating_point, registered
from tests.gate_records import PARAMS, REAL, passing, run
from tests.test_gate import LIMITS

REPO = Path(__file__).resolve().parents[1]
FP32_100 = PARAMS | {"workload.shots.arc_easy": "100", "workload.shots.boolq": "100"}
BF16_200 = PARAMS | {"pair.dtype": "bfloat16", "workload.shots.arc_easy": "200", "workload.shots.boolq": "200"}
NO_PLANS = Plans(since=0, entries=())
_names = itertools.count()


def plans_file(tmp_path: Path, *entries: dict, since: str = "2026-12-06T00:00:00+00:00") -> Path:
    path = tmp_path / f"plans_{next(_names)}.yaml"
    path.write_text(json.dumps({"since": since, "plans": list(entries)}))  # JSON is YAML
    return path


def entry(id: str, config: dict, registered: str = "2026-12-06T02:00:00+00:00") -> dict:
    return {"id": id, "registered": registered, "workload": "fewshot", "direction": "small_to_large", "config": config}


LOST = passing(100, lost=30)  # 30 points lost on every task: FAIL


def test_dtype_and_shots_are_part_of_the_operating_point():
    """bf16 200-shot does not replace fp32 100-shot as 'the latest': two points, each judged on its own run."""
    fp32, bf16 = run(passing(), params=FP32_100), run(LOST, params=BF16_200)
    assert operating_point(fp32) == "≤ 512 tokens, fp32, 100 shots, pure transfer"
    assert operating_point(bf16) == "≤ 512 tokens, bf16, 200 shots, pure transfer"
    decisions = decide([fp32, bf16], NO_PLANS, LIMITS)
    assert [(d.point.split(", ")[1], d.chosen.judged.run_id) for d in decisions] == [
        ("bf16", bf16.run_id),
        ("fp32", fp32.run_id),
    ]


def test_levers_policy_and_engine_are_part_of_the_operating_point():
    recompute = PARAMS | {"policy.levers.native_sink": "4", "policy.levers.recompute": "0.4"}
    recompute |= {"policy.levers.recompute_rule": "deviation"}
    assert operating_point(run(passing(), params=recompute)).endswith("native_sink=4, recompute=0.4, rule=deviation")
    assert operating_point(run(passing(), tags=REAL | {"policy": "auto", "engine": "graph"})).endswith(
        "pure transfer, policy auto, engine graph"
    )
    assert len(decide([run(passing()), run(passing(), params=recompute)], NO_PLANS, LIMITS)) == 2


def test_a_re_run_to_pass_is_never_judged(tmp_path):
    """The plan names the run before it runs; the first such run FAILs; re-running until one passes changes
    nothing: the point is judged on the registered run, the re-run counted."""
    plans = load_plans(plans_file(tmp_path, entry("p1", {"pair.dtype": "float32"})))
    first, again = run(LOST), run(passing())
    (decision,) = decide([again, first], plans, LIMITS)  # any order
    assert decision.chosen.judged.run_id == first.run_id and decision.outcome == "FAIL"
    assert (decision.chosen.runs, decision.chosen.later) == (2, 1)
    assert "plan p1's run, of 2, 1 later not judged" in summary_table([decision])
    (alone,) = decide([again], plans, LIMITS)  # had it been the first, it would pass
    assert alone.outcome == "PASS"


def test_a_point_reads_its_worst_criterion_and_undecided_is_never_fail(tmp_path):
    """A registered run whose only open criterion is quality reads UNDERPOWERED (not shown either way), one with a
    failing criterion FAIL; neither passes. Unregistered, the criteria say the same in parentheses."""
    plans = load_plans(plans_file(tmp_path, entry("p1", {})))
    undecided = run(passing(200, lost=20, gained=20))
    (decision,) = decide([undecided], plans, LIMITS)
    statuses = {v.criterion.split(":")[0]: v.status for v in decision.verdicts}
    assert statuses.pop("quality") == "UNDERPOWERED" and set(statuses.values()) == {"PASS"}, statuses
    assert decision.outcome == "UNDERPOWERED" and not decision.passed
    (failed,) = decide([run(LOST)], plans, LIMITS)
    assert failed.outcome == "FAIL" and not failed.passed
    (shown,) = decide([run(passing(200, lost=20, gained=20))], NO_PLANS, LIMITS)
    assert shown.outcome == "UNREGISTERED (no plan entry; criteria UNDERPOWERED)"


def test_an_unregistered_point_is_reported_never_passed(tmp_path):
    """No plan entry: the latest run is shown, its criteria too, and the verdict is UNREGISTERED — 'predates plans'
    for a run that started before pre-registration began."""
    plans = load_plans(plans_file(tmp_path, entry("other", {"pair.dtype": "bfloat16"})))
    (decision,) = decide([run(LOST), latest := run(passing())], plans, LIMITS)
    assert decision.chosen.judged.run_id == latest.run_id and decision.chosen.plan is None
    assert decision.outcome == "UNREGISTERED (no plan entry; criteria PASS)" and not decision.passed
    early = load_plans(plans_file(tmp_path, since="2040-01-01T00:00:00+00:00"))
    (old,) = decide([run(passing())], early, LIMITS)
    assert old.outcome == "UNREGISTERED (predates plans; criteria PASS)"


def test_a_plan_names_only_runs_that_start_after_it(tmp_path):
    plans = load_plans(plans_file(tmp_path, entry("late", {}, registered="2040-01-01T00:00:00+00:00")))
    (decision,) = decide([run(passing())], plans, LIMITS)
    assert decision.chosen.plan is None


def test_a_plan_entry_names_one_run_whichever_point_it_lands_in(tmp_path):
    """A loose entry (no dtype) names the first matching run; a later run of another point is not its run either."""
    plans = load_plans(plans_file(tmp_path, entry("loose", {})))
    first, other = run(passing(), params=FP32_100), run(passing(), params=BF16_200)
    outcomes = {d.chosen.judged.run_id: d.outcome for d in decide([first, other], plans, LIMITS)}
    assert outcomes[first.run_id] == "PASS" and outcomes[other.run_id].startswith("UNREGISTERED")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("plans: []", "needs `since`"),
        ('{"since": "2026-12-06", "plans": []}', "has no time zone"),
        ('{"since": "yesterday", "plans": []}', "is not an ISO time"),
        ('{"since": "2026-12-06T00:00:00+00:00", "plans": [{"id": "a"}]}', "an entry needs id, registered"),
    ],
)
def test_a_bad_plans_file_is_refused_naming_the_problem(tmp_path, text, error):
    path = tmp_path / "plans.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_plans(path)


def test_the_committed_plans_name_the_device_stage_gate_and_no_committed_run():
    """results/gate_plans.yaml registers the joined record of `scripts/device_quality.sh gate` (params as
    src/routed_merge.py writes them), and no committed record is any entry's run."""
    from src.report.benchmarks import RESULTS
    from src.report.routed_tables import run_of
    from src.report.rows import record_rows

    plans = load_plans(REPO / "results/gate_plans.yaml")
    joined = PARAMS | {
        "pair.dtype": "bfloat16",
        "workload.shots.arc_easy": "200",
        "workload.shots.arc_challenge": "200",
    }
    joined |= {"workload.limit": "400", "workload.shards": "4", "workload.shard": "all", "policy.mode": "map"}
    tags = REAL | {"direction": "qwen25coder_0.5b_to_1.5b", "engine": "graph"}
    device = run(passing(), params=joined, tags=tags)  # started after the registration
    assert registered([device], plans)[device.run_id].id == "gate-fewshot200-bf16-graph-up"
    committed = [run_of(row) for folder in RESULTS.glob("routed*") for row in record_rows(folder)]
    assert len(committed) == 25 and registered(committed, plans) == {}


def test_a_de_tagged_shard_is_never_judged_alone():
    part = run(passing(), params=PARAMS | {"workload.shards": "2", "workload.shard": "0"})
    assert decide([part], NO_PLANS, LIMITS) == []
    joined = run(passing(), params=PARAMS | {"workload.shards": "2", "workload.shard": "all"})
    assert len(decide([part, joined], NO_PLANS, LIMITS)) == 1


def test_a_later_validation_run_does_not_shadow_the_test_run():
    reported = run(passing())
    (decision,) = decide([reported, run(LOST, tags=REAL | {"split": "valid"})], NO_PLANS, LIMITS)
    assert decision.chosen.judged.run_id == reported.run_id and decision.validation == 1


# --- check over an MLflow store ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('gate') / 'mlflow.db'}"


@pytest.fixture
def experiment(uri) -> str:
    name = f"gate_{next(_names)}"
    mlflow.set_tracking_uri(uri)
    mlflow.create_experiment(name)
    return name


def plant(uri: str, experiment: str, planted, status: str = "FINISHED", items: bool = True) -> str:
    """The planted run (tests/gate_records.py) in MLflow: metrics, params, tags and its items artifact."""
    client = MlflowClient(uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    start = planted.start_time
    made = client.create_run(experiment_id, start_time=start, tags=planted.tags, run_name=planted.name)
    metrics = [Metric(k, v, start, 0) for k, v in planted.metrics.items()]
    client.log_batch(made.info.run_id, metrics=metrics, params=[Param(k, v) for k, v in planted.params.items()])
    if items:
        document = {"items": planted.items, "handoffs": planted.handoffs, "policy": "map"}
        client.log_text(made.info.run_id, json.dumps(document), "routed/items.json")
    client.set_terminated(made.info.run_id, status, start + 1)
    return made.info.run_id


def gate(uri: str, experiment: str, plans: Path, **kwargs) -> int:
    return check(uri, experiment, None, 2.0, 5.0, plans=plans, **kwargs)


def test_check_judges_the_registered_run_and_fails_the_unregistered(uri, experiment, tmp_path, capsys):
    plans = plans_file(tmp_path, entry("p", {"pair.dtype": "float32"}))
    first = plant(uri, experiment, run(passing()))
    plant(uri, experiment, run(LOST))  # a later re-run that fails: not judged
    assert gate(uri, experiment, plans, summary=True) == 0
    out = capsys.readouterr().out
    assert "≤ 512 tokens, fp32, pure transfer: PASS — run planted" in out and first[:8] in out
    assert "plan p's run, of 2, 1 later not judged" in out and out.rstrip().endswith("gate: PASS")
    assert "| fewshot | small_to_large | ≤ 512 tokens, fp32, pure transfer | plan p's run" in out
    assert gate(uri, experiment, plans_file(tmp_path)) == 1  # no plan: UNREGISTERED
    assert "UNREGISTERED (no plan entry; criteria FAIL)" in capsys.readouterr().out


def test_naming_a_run_after_the_fact_does_not_register_it(uri, experiment, tmp_path, capsys):
    plans = plans_file(tmp_path, entry("p", {"pair.dtype": "float32"}))
    plant(uri, experiment, run(LOST))
    best = plant(uri, experiment, run(passing()))
    assert gate(uri, experiment, plans, run=best) == 1
    assert "UNREGISTERED (no plan entry; criteria PASS)" in capsys.readouterr().out
    assert gate(uri, experiment, plans, run="0" * 32) == 1


def test_check_reads_the_items_and_counts_shards(uri, experiment, tmp_path, capsys):
    plans = plans_file(tmp_path, entry("p", {}))
    plant(uri, experiment, run(passing(), params=PARAMS | {"workload.shards": "2", "workload.shard": "1"}))
    plant(uri, experiment, run(passing()), items=False)  # no items artifact: judged on nothing
    assert gate(uri, experiment, plans) == 1
    out = capsys.readouterr().out
    assert "1 item shard(s) of runs not judged alone" in out
    assert "MISSING      record: logged = items" in out and "no items artifact" in out


def test_a_damaged_items_artifact_is_named(uri, experiment, tmp_path):
    from src.records import RecordError

    run_id = plant(uri, experiment, run(passing()), items=False)
    MlflowClient(uri).log_text(run_id, '{"items": [{"ttft": ', "routed/items.json")
    with pytest.raises(RecordError, match=r"routed/items\.json: not valid JSON, truncated or damaged"):
        gate(uri, experiment, plans_file(tmp_path))


def test_missing_experiment_or_runs_fail(uri, experiment, tmp_path, capsys):
    assert gate(uri, "no_such_experiment", plans_file(tmp_path)) == 1
    plant(uri, experiment, run(passing(), tags=REAL | {"job": "fit_eval"}))
    plant(uri, experiment, run(passing()), status="RUNNING")
    assert gate(uri, experiment, plans_file(tmp_path)) == 1
    assert "no finished routed runs to judge" in capsys.readouterr().out


@pytest.mark.parametrize(("key", "value"), [("min_speedup", float("nan")), ("max_loss", -1.0)])
def test_an_impossible_threshold_or_plan_is_refused_before_any_run_is_read(key, value, tmp_path):
    with pytest.raises(ValueError, match="must be finite and in"):
        check(f"sqlite:///{tmp_path / 'never.db'}", "routed", **{key: value})
    bad = tmp_path / "bad.yaml"
    bad.write_text("plans: [")
    with pytest.raises(ValueError, match="cannot read the gate's plans"):
        check(f"sqlite:///{tmp_path / 'never.db'}", "routed", plans=bad)
    assert not (tmp_path / "never.db").exists()  # the store was never opened


def test_cli_and_hydra_job_exit_status(uri, experiment, tmp_path, monkeypatch):
    """The CLI's thresholds and plans; the Hydra job (src/run.py) reads the committed plans: a planted run there is
    unregistered, so the job exits 1."""
    from hydra import compose, initialize_config_dir

    from src.run import main

    plans = plans_file(tmp_path, entry("p", {}))
    plant(uri, experiment, run(passing(420)))
    command = [sys.executable, "-m", "src.gate", "--experiment", experiment, "--uri", uri, "--plans", str(plans)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr  # 420 items per task pass the YAML's 1-point margin
    bad = subprocess.run([*command, "--max-loss-points", "nan"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "gate max_loss_points must be finite" in bad.stderr and "Traceback" not in bad.stderr
    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path / "home"))
    for name in (experiment, "absent"):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("run", overrides=["+experiment=gate", f"gate.experiment={name}", f"tracking.uri={uri}"])
        with pytest.raises(SystemExit) as exit_info:
            main.__wrapped__(cfg)
        assert exit_info.value.code == 1, name
