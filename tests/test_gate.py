"""Promotion gate: per-run criteria (`judge_run`), per-direction verdicts over a planted MLflow sqlite store
(`check`), and the exit status of the CLI and of the Hydra `job=gate`. Nothing passes by default."""

import itertools
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from src.gate import check, judge_run

REPO = Path(__file__).resolve().parents[1]
SPEEDUP, LOSS = 2.0, 1.0
PASSING = {
    "handoff_speedup": 3.0,
    "rollback_verified": 1.0,
    "task.hellaswag.loss_points": 0.4,
    "task.arc_easy.loss_points": 1.0,
}
REAL = {"weights": "real", "job": "fit_eval", "direction": "small_to_large"}
_names = itertools.count()


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('gate') / 'mlflow.db'}"


@pytest.fixture
def experiment(uri) -> str:
    """A fresh, empty experiment in the module's store."""
    name = f"gate_{next(_names)}"
    mlflow.set_tracking_uri(uri)
    mlflow.create_experiment(name)
    return name


def plant(uri: str, experiment: str, metrics: dict, tags: dict, parent: str | None = None, finish: bool = True) -> str:
    """One run with these metrics and tags (a child of `parent` when given); returns its id."""
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    run = mlflow.start_run(
        run_name=f"planted_{next(_names)}", tags=tags, parent_run_id=parent, nested=parent is not None
    )
    mlflow.log_metrics(metrics)
    if finish:
        mlflow.end_run()
    else:
        mlflow.end_run(status="RUNNING")
    return run.info.run_id


def gate(uri: str, experiment: str, parent: str | None = None) -> int:
    return check(uri, experiment, parent, SPEEDUP, LOSS)


def statuses(metrics: dict, tags: dict) -> list[str]:
    return [v.status for v in judge_run(metrics, tags, SPEEDUP, LOSS)]


def without(mapping: dict, *keys: str) -> dict:
    return {k: v for k, v in mapping.items() if k not in keys}


# --- judge_run ----------------------------------------------------------------------------------------------------


def test_judge_passing_run():
    verdicts = judge_run(PASSING, REAL, SPEEDUP, LOSS)
    assert [v.criterion.split(":")[0] for v in verdicts] == ["latency", "quality", "rollback to prefill"]
    assert [v.status for v in verdicts] == ["PASS", "PASS", "PASS"]
    assert "arc_easy" in verdicts[1].measured  # the worst task is reported


def test_judge_thresholds_are_inclusive():
    at = PASSING | {"handoff_speedup": SPEEDUP, "task.hellaswag.loss_points": LOSS}
    assert statuses(at, REAL) == ["PASS", "PASS", "PASS"]
    assert statuses(PASSING | {"task.hellaswag.loss_points": -3.0}, REAL) == ["PASS", "PASS", "PASS"]  # better


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        (without(PASSING, "handoff_speedup"), ["MISSING", "PASS", "PASS"]),
        (without(PASSING, "rollback_verified"), ["PASS", "PASS", "MISSING"]),
        (without(PASSING, "task.hellaswag.loss_points", "task.arc_easy.loss_points"), ["PASS", "MISSING", "PASS"]),
        ({}, ["MISSING", "MISSING", "MISSING"]),
        (PASSING | {"handoff_speedup": 1.5}, ["FAIL", "PASS", "PASS"]),
        (PASSING | {"task.hellaswag.loss_points": 2.3}, ["PASS", "FAIL", "PASS"]),
        (PASSING | {"rollback_verified": 0.0}, ["PASS", "PASS", "FAIL"]),
        (PASSING | {"handoff_speedup": float("nan")}, ["FAIL", "PASS", "PASS"]),
        (PASSING | {"rollback_verified": float("nan")}, ["PASS", "PASS", "FAIL"]),
    ],
    ids=[
        "no-speedup",
        "no-rollback",
        "no-tasks",
        "nothing",
        "speedup-1.5",
        "loss-2.3",
        "rollback-0",
        "speedup-nan",
        "rollback-nan",
    ],
)
def test_judge_missing_and_failing(metrics, expected):
    assert statuses(metrics, REAL) == expected


def test_task_metrics_need_the_exact_name():
    """Only `task.<name>.loss_points` counts as a task measurement."""
    others = without(PASSING, "task.hellaswag.loss_points", "task.arc_easy.loss_points") | {
        "hellaswag.loss_points": 0.0,
        "task.hellaswag.acc": 0.9,
        "task.hellaswag.loss_points_se": 0.1,
    }
    assert statuses(others, REAL)[1] == "MISSING"


@pytest.mark.parametrize("weights", ["random", None, "Real"])
def test_random_weights_never_pass_quality(weights):
    tags = REAL | {"weights": weights} if weights else without(REAL, "weights")
    verdicts = judge_run(PASSING | {"task.hellaswag.loss_points": 0.0}, tags, SPEEDUP, LOSS)
    assert verdicts[1].status == "MISSING"
    assert [verdicts[0].status, verdicts[2].status] == ["PASS", "PASS"]


def test_nan_task_loss_never_passes():
    metrics = PASSING | {"task.zz_broken.loss_points": float("nan")}
    assert statuses(metrics, REAL)[1] == "FAIL"


# --- check over an MLflow store -----------------------------------------------------------------------------------


def test_missing_experiment_fails(uri, capsys):
    assert gate(uri, "no_such_experiment") == 1
    assert "no MLflow experiment" in capsys.readouterr().out


def test_no_runs_fails(uri, experiment, capsys):
    assert gate(uri, experiment) == 1
    assert "no finished fit_eval runs" in capsys.readouterr().out


def test_only_fit_eval_and_finished_runs_count(uri, experiment):
    plant(uri, experiment, PASSING, REAL | {"job": "latency"})
    plant(uri, experiment, PASSING, without(REAL, "job"))
    plant(uri, experiment, PASSING, REAL, finish=False)
    assert gate(uri, experiment) == 1
    plant(uri, experiment, PASSING, REAL)
    assert gate(uri, experiment) == 0


@pytest.mark.parametrize(
    "metrics",
    [
        without(PASSING, "handoff_speedup"),
        without(PASSING, "rollback_verified"),
        without(PASSING, "task.hellaswag.loss_points", "task.arc_easy.loss_points"),
        {},
    ],
    ids=["no-speedup", "no-rollback", "no-tasks", "nothing"],
)
def test_missing_evidence_fails(uri, experiment, metrics, capsys):
    plant(uri, experiment, metrics, REAL)
    assert gate(uri, experiment) == 1
    out = capsys.readouterr().out
    assert "MISSING" in out and out.rstrip().endswith("gate: FAIL")


@pytest.mark.parametrize(
    "bad",
    [{"handoff_speedup": 1.5}, {"task.hellaswag.loss_points": 2.3}, {"rollback_verified": 0.0}],
    ids=["speedup-1.5", "loss-2.3", "rollback-0"],
)
def test_planted_failing_metric_fails(uri, experiment, bad, capsys):
    plant(uri, experiment, PASSING | bad, REAL)
    assert gate(uri, experiment) == 1
    out = capsys.readouterr().out
    assert "  FAIL " in out and out.rstrip().endswith("gate: FAIL")


def test_planted_passing_run_passes(uri, experiment, capsys):
    plant(uri, experiment, PASSING, REAL)
    assert gate(uri, experiment) == 0
    out = capsys.readouterr().out
    assert "small_to_large: PASS" in out and out.rstrip().endswith("gate: PASS")
    assert "MISSING" not in out and " FAIL " not in out


def test_random_weight_runs_never_pass(uri, experiment):
    for speedup in (3.0, 50.0):
        plant(uri, experiment, PASSING | {"handoff_speedup": speedup}, REAL | {"weights": "random"})
    assert gate(uri, experiment) == 1


def test_a_direction_passes_when_one_of_its_runs_passes(uri, experiment, capsys):
    plant(uri, experiment, PASSING | {"handoff_speedup": 9.0, "rollback_verified": 0.0}, REAL)
    plant(uri, experiment, PASSING | {"handoff_speedup": 20.0}, REAL | {"weights": "random"})
    good = plant(uri, experiment, PASSING, REAL)
    assert gate(uri, experiment) == 0
    assert f"({good[:8]}, weights=real)" in capsys.readouterr().out  # the passing run is the one reported


def test_every_direction_must_pass(uri, experiment, capsys):
    plant(uri, experiment, PASSING, REAL)
    plant(uri, experiment, PASSING | {"task.hellaswag.loss_points": 2.3}, REAL | {"direction": "large_to_small"})
    assert gate(uri, experiment) == 1
    out = capsys.readouterr().out
    assert "small_to_large: PASS" in out and "large_to_small: FAIL" in out
    plant(uri, experiment, PASSING, REAL | {"direction": "large_to_small"})
    assert gate(uri, experiment) == 0


def test_runs_without_direction_are_judged_as_unknown(uri, experiment, capsys):
    plant(uri, experiment, PASSING, without(REAL, "direction"))
    assert gate(uri, experiment) == 0
    assert "unknown: PASS" in capsys.readouterr().out


def test_parent_filter(uri, experiment, capsys):
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name="sweep") as parent:
        plant(uri, experiment, PASSING, REAL, parent=parent.info.run_id)
    with mlflow.start_run(run_name="other_sweep") as other:
        plant(
            uri,
            experiment,
            PASSING | {"handoff_speedup": 1.5},
            REAL | {"direction": "large_to_small"},
            other.info.run_id,
        )
    assert gate(uri, experiment) == 1  # all runs: large_to_small fails
    assert "large_to_small: FAIL" in capsys.readouterr().out
    assert gate(uri, experiment, parent.info.run_id) == 0
    out = capsys.readouterr().out
    assert "best of 1 run(s)" in out and "large_to_small" not in out and out.rstrip().endswith("gate: PASS")
    assert gate(uri, experiment, other.info.run_id) == 1
    assert gate(uri, experiment, "0" * 32) == 1
    assert "under " + "0" * 32 in capsys.readouterr().out


# --- entry points -------------------------------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "src.gate", *args], cwd=REPO, capture_output=True, text=True, timeout=180
    )


def test_cli_exit_status(uri, experiment):
    parent_experiment = f"{experiment}_sweep"
    plant(uri, experiment, PASSING | {"handoff_speedup": 1.5}, REAL)
    mlflow.set_experiment(parent_experiment)
    with mlflow.start_run(run_name="sweep") as parent:
        plant(uri, parent_experiment, PASSING, REAL, parent=parent.info.run_id)
    failing = cli("--experiment", experiment, "--uri", uri)
    assert failing.returncode == 1, failing.stderr
    assert "gate: FAIL" in failing.stdout
    passing = cli("--experiment", parent_experiment, "--uri", uri, "--parent", parent.info.run_id)
    assert passing.returncode == 0, passing.stdout + passing.stderr
    assert "gate: PASS" in passing.stdout
    lenient = cli("--experiment", experiment, "--uri", uri, "--min-speedup", "1.2")
    assert lenient.returncode == 0, lenient.stdout + lenient.stderr


def test_run_gate_job_exit_status(uri, experiment, tmp_path, monkeypatch):
    """`python -m src.run +experiment=gate` exits with the gate's status (the Hydra task function, in-process)."""
    from hydra import compose, initialize_config_dir

    from src.run import main

    plant(uri, experiment, PASSING, REAL)
    failing = f"{experiment}_failing"
    mlflow.set_experiment(failing)
    plant(uri, failing, PASSING | {"rollback_verified": 0.0}, REAL)
    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path / "home"))
    for name, parent, status in (
        (experiment, None, 0),
        (failing, None, 1),
        ("absent", None, 1),
        (experiment, "0" * 32, 1),
    ):
        overrides = [
            "+experiment=gate",
            f"gate.experiment={name}",
            f"tracking.uri={uri}",
            f"gate.parent={parent or 'null'}",
        ]
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("run", overrides=overrides)
        with pytest.raises(SystemExit) as exit_info:
            main.__wrapped__(cfg)
        assert exit_info.value.code == status, (name, parent)
