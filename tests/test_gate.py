"""Promotion gate on ONE routed-workload run (src/gate.py): the issue's loophole no longer passes, a planted passing run
passes, random-weight runs never pass quality, quality is a non-inferiority test on the CI against the margin (with
the items that would decide an UNDERPOWERED task), latency needs the speedup CI's lower bound and a transfer's prefill
fraction, non-finite measurements are MISSING and impossible thresholds a clear error, a run without a split tag is
refused, the latest run of a (workload, direction) is judged — never the best — and the CLI / Hydra `job=gate` exit
statuses."""

import itertools
import math
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from src.gate import Thresholds, backfill, check, history_regime, items_to_decide, judge_run, thresholds
from src.tracking import RecordError

REPO = Path(__file__).resolve().parents[1]
PASSING = {
    "ttft_speedup": 3.0,
    "ttft_speedup_low": 2.5,
    "ttft_speedup_high": 3.4,
    "ttft.routed_ms_p50": 12.0,
    "ttft.same_work_ratio": 1.05,
    "ttft.same_work_items": 25.0,
    "rollback_verified": 1.0,
    "prefill_fraction": 0.05,
    "task.arc_easy.loss_points": -0.4,
    "task.arc_easy.loss_points_low": -1.2,
    "task.arc_easy.loss_points_high": 0.9,
    "task.mmlu.loss_points": 0.0,
    "task.mmlu.loss_points_low": -0.9,
    "task.mmlu.loss_points_high": 1.0,  # the CI's upper bound on the margin: non-inferior
}
REAL = {"weights": "real", "job": "routed", "workload": "fewshot", "direction": "small_to_large", "split": "test"}
ALL_PASS = ["PASS"] * 6  # routed, latency, harness, quality, prefill, rollback
LIMITS = Thresholds(min_speedup=2.0, max_loss_points=1.0, max_harness_skew=1.25, max_prefill_fraction=0.5)
_names, _clock = itertools.count(), itertools.count(1_700_000_000_000, 1000)


def statuses(metrics: dict, tags: dict = REAL) -> list[str]:
    return [v.status for v in judge_run(metrics, tags, LIMITS)]


def verdict(metrics: dict, name: str, tags: dict = REAL):
    (found,) = [v for v in judge_run(metrics, tags, LIMITS) if v.criterion.startswith(name)]
    return found


def without(mapping: dict, *keys: str) -> dict:
    return {k: v for k, v in mapping.items() if k not in keys}


def expect(**changes: str) -> list[str]:
    """ALL_PASS with the named criteria changed (routed, latency, harness, quality, prefill, rollback)."""
    order = ("routed", "latency", "harness", "quality", "prefill", "rollback")
    return [changes.get(name, "PASS") for name in order]


# --- judge_run ----------------------------------------------------------------------------------------------------


def test_the_issue_loophole_no_longer_passes():
    """Hold-back over nearly the whole prompt, a fast mapper on a long latency prefix, a CI of ±10 points."""
    loophole = {
        "handoff_speedup": 2.1,
        "rollback_verified": 1,
        "task.piqa.loss_points": 1.0,
        "task.piqa.loss_points_low": -9,
        "task.piqa.loss_points_high": 11,
        "task.mean.prefill_fraction": 1.0,
    }
    verdicts = judge_run(loophole, {"weights": "real"})  # thresholds from the YAML
    assert not any(v.passed for v in verdicts[:5])
    assert [v.status for v in verdicts] == ["MISSING", "MISSING", "MISSING", "UNDERPOWERED", "MISSING", "PASS"]
    assert "piqa +1.00 [-9.00, +11.00]" in verdicts[3].measured  # printed with its CI
    # even as a routed run with an end-to-end TTFT whose CI clears 2×: it re-prefilled everything, not a transfer
    routed = loophole | {
        "ttft_speedup": 2.1,
        "ttft_speedup_low": 2.05,
        "ttft_speedup_high": 2.2,
        "prefill_fraction": 1.0,
    }
    assert statuses(routed) == ["PASS", "FAIL", "MISSING", "UNDERPOWERED", "FAIL", "PASS"]
    assert "1.00 of the prefill spent: not a transfer" in verdict(routed, "latency:").measured


def test_planted_passing_run_passes():
    verdicts = judge_run(PASSING, REAL, LIMITS)
    assert [v.status for v in verdicts] == ALL_PASS and all(v.passed for v in verdicts)
    assert "arc_easy -0.40 [-1.20, +0.90]" in verdicts[3].measured and "0.050" in verdicts[4].measured
    assert "3.00× [2.50, 3.40]" in verdicts[1].measured
    assert [v.status for v in judge_run(PASSING, REAL)] == ALL_PASS  # the YAML's thresholds


def test_a_run_on_validation_items_or_without_a_split_is_never_judged_as_test():
    """Validation items choose levers (`workload.split=valid`); only test items are reported and gated; a run that
    does not say which items it scored is refused, never read as test items."""
    assert statuses(PASSING, REAL | {"split": "valid"}) == expect(routed="FAIL")
    untagged = without(REAL, "split")
    assert statuses(PASSING, untagged) == expect(routed="MISSING")
    assert "split=— (no split tag)" in verdict(PASSING, "routed", untagged).measured


@pytest.mark.parametrize("weights", ["random", None, "Real"])
def test_random_weight_runs_never_pass_quality(weights):
    tags = REAL | {"weights": weights} if weights else without(REAL, "weights")
    perfect = PASSING | {"task.arc_easy.loss_points": -5.0, "task.mmlu.loss_points": 0.0}
    assert statuses(perfect, tags)[3] == "MISSING"


INF, NAN = math.inf, math.nan
SLOW = {"ttft_speedup": 1.7, "ttft_speedup_low": 1.5, "ttft_speedup_high": 1.9}


@pytest.mark.parametrize(
    ("metrics", "tags", "expected"),
    [
        (without(PASSING, "ttft_speedup"), REAL, expect(latency="MISSING")),
        (without(PASSING, "ttft_speedup_low", "ttft_speedup_high"), REAL, expect(latency="MISSING")),  # no CI logged
        (PASSING | {"handoff_speedup": 9.0} | SLOW, REAL, expect(latency="FAIL")),  # the CI lies below 2×
        (PASSING | {"ttft_speedup": 2.1, "ttft_speedup_low": 1.8}, REAL, expect(latency="UNDERPOWERED")),
        (PASSING | {"ttft_speedup": NAN}, REAL, expect(latency="MISSING")),
        (PASSING | {"ttft_speedup": INF, "ttft_speedup_high": INF}, REAL, expect(latency="MISSING")),
        (PASSING | {"ttft_speedup_low": 3.5}, REAL, expect(latency="MISSING")),  # inverted CI: low > high
        (
            PASSING | {"ttft_speedup_low": sys.float_info.max, "ttft_speedup_high": sys.float_info.max},
            REAL,
            expect(latency="MISSING"),
        ),
        (PASSING | {"prefill_fraction": 0.6}, REAL, expect(latency="FAIL", prefill="FAIL")),  # not a transfer
        (PASSING | {"prefill_fraction": NAN}, REAL, expect(latency="MISSING", prefill="MISSING")),
        (without(PASSING, "prefill_fraction"), REAL, expect(latency="MISSING", prefill="MISSING")),
        (without(PASSING, "rollback_verified"), REAL, expect(rollback="MISSING")),
        (PASSING | {"rollback_verified": 0.0}, REAL, expect(rollback="FAIL")),
        (PASSING, REAL | {"job": "fit_eval"}, expect(routed="MISSING")),
        (PASSING, without(REAL, "workload"), expect(routed="MISSING")),
        ({}, REAL, ["PASS", "MISSING", "MISSING", "MISSING", "MISSING", "MISSING"]),
        # the baseline's own work timed 1.9× slower than the same work in the routed session: the clock made it
        (PASSING | {"ttft.same_work_ratio": 1.9, "ttft.same_work_items": 175.0}, REAL, expect(harness="FAIL")),
        (PASSING | {"ttft.same_work_ratio": 0.7}, REAL, expect(harness="FAIL")),
        (PASSING | {"ttft.same_work_ratio": NAN}, REAL, expect(harness="MISSING")),
        (PASSING | {"ttft.same_work_ratio": INF}, REAL, expect(harness="MISSING")),
        (without(PASSING, "ttft.same_work_ratio", "ttft.same_work_items"), REAL, expect(harness="MISSING")),
    ],
    ids=[
        "no-ttft",
        "no-ci",
        "slow",
        "ci-straddles",
        "nan-ttft",
        "inf-ttft",
        "inverted-ci",
        "mlflow-inf",
        "prefill-over",
        "nan-prefill",
        "no-prefill",
        "no-rollback",
        "rollback-0",
        "not-routed",
        "no-workload",
        "empty",
        "harness-slow-baseline",
        "harness-slow-routed",
        "harness-nan",
        "harness-inf",
        "harness-none",
    ],
)
def test_missing_or_failing_criteria(metrics, tags, expected):
    assert statuses(metrics, tags) == expected


def test_latency_without_a_ci_says_so():
    assert verdict(without(PASSING, "ttft_speedup_low", "ttft_speedup_high"), "latency:").measured == (
        "3.00× (no CI logged)"
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"task.mmlu.loss_points_high": 1.01}, "UNDERPOWERED"),  # the CI reaches past the margin
        ({"task.mmlu.loss_points_high": (0.54 - 0.53) * 100}, "PASS"),  # one item in 100: the margin, float or not
        ({"task.mmlu.loss_points_high": 5.0}, "UNDERPOWERED"),
        (
            {"task.mmlu.loss_points": 3.0, "task.mmlu.loss_points_low": 0.5, "task.mmlu.loss_points_high": 5.5},
            "UNDERPOWERED",
        ),
        ({"task.mmlu.loss_points": 3.0, "task.mmlu.loss_points_low": 1.2, "task.mmlu.loss_points_high": 5.0}, "FAIL"),
        ({"task.mmlu.loss_points": NAN}, "MISSING"),
        ({"task.mmlu.loss_points_high": INF}, "MISSING"),
        ({"task.mmlu.loss_points_high": sys.float_info.max}, "MISSING"),  # what MLflow stores for +inf
        ({"task.mmlu.loss_points_low": 2.0}, "MISSING"),  # inverted: low > high
        ({"task.mmlu.loss_points_low": None}, "MISSING"),  # no CI: cannot be judged
        (
            {"task.mmlu.loss_points": 3.0, "task.mmlu.loss_points_low": 1.2, "task.mmlu.loss_points_high": NAN},
            "MISSING",
        ),
        (
            {
                "task.arc_easy.loss_points": -3.0,
                "task.arc_easy.loss_points_low": -4.0,
                "task.arc_easy.loss_points_high": -1.0,
            },
            "PASS",
        ),  # better than native
    ],
    ids=[
        "ci-past-margin",
        "one-item-in-100",
        "wide-ci",
        "loss-over-margin-undecided",
        "ci-beyond-margin",
        "nan",
        "inf",
        "mlflow-inf",
        "inverted",
        "no-ci",
        "fail-and-nan",
        "better",
    ],
)
def test_quality_is_non_inferiority_on_the_ci(change, expected):
    metrics = {k: v for k, v in (PASSING | change).items() if v is not None}
    assert statuses(metrics)[3] == expected


@pytest.mark.parametrize(
    ("loss", "sd", "margin", "items"),
    [(0.0, 20.0, 1.0, 1537), (3.0, 20.0, 1.0, 385), (-3.33, 25.0, 1.0, 129), (0.83, 26.0, 1.0, 89859)],
)
def test_items_to_decide_is_where_the_ci_bound_reaches_the_margin(loss, sd, margin, items):
    """⌈(1.96·sd / |margin − loss|)²⌉: at that many items the CI's half-width fits between the loss and the margin,
    at one item fewer it does not."""
    assert items_to_decide(loss, sd, margin) == items
    gap = abs(margin - loss)
    assert 1.96 * sd / math.sqrt(items) <= gap < 1.96 * sd / math.sqrt(items - 1)


@pytest.mark.parametrize(("loss", "sd"), [(1.0, 20.0), (0.5, NAN), (NAN, 20.0)])
def test_no_item_count_decides_a_loss_on_the_margin_or_without_a_spread(loss, sd):
    assert items_to_decide(loss, sd, 1.0) is None


def test_an_underpowered_task_says_how_many_items_would_decide_it():
    """Below the margin: the items that would show PASS; above it (a CI that still reaches below): FAIL."""
    wide = PASSING | {"task.mmlu.loss_points_high": 5.0, "task.mmlu.loss_points_sd": 20.0}
    quality = verdict(wide, "quality")
    assert quality.status == "UNDERPOWERED"
    assert "mmlu +0.00 [-0.90, +5.00] (≈ 1537 items would show PASS at this loss)" in quality.measured
    over = wide | {"task.mmlu.loss_points": 3.0, "task.mmlu.loss_points_low": 0.5}
    assert "mmlu +3.00 [+0.50, +5.00] (≈ 385 items would show FAIL at this loss)" in verdict(over, "quality").measured
    unknown = verdict(wide | {"task.mmlu.loss_points_sd": NAN}, "quality")
    assert unknown.status == "UNDERPOWERED" and "items would" not in unknown.measured  # one item: no spread, no plan
    on_margin = verdict(wide | {"task.mmlu.loss_points": 1.0}, "quality")
    assert "mmlu +1.00 [-0.90, +5.00] (on the margin: no item count decides it at this loss)" in on_margin.measured
    decided = verdict(over | {"task.mmlu.loss_points_low": 1.5}, "quality")
    assert decided.status == "FAIL" and "items would" not in decided.measured


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_harness_skew", 0.8),
        ("max_harness_skew", NAN),
        ("max_loss_points", -1.0),
        ("max_loss_points", NAN),
        ("min_speedup", 0.5),
        ("min_speedup", INF),
        ("max_prefill_fraction", 1.5),
        ("max_prefill_fraction", NAN),
    ],
)
def test_a_threshold_that_cannot_hold_is_a_clear_error(key, value):
    with pytest.raises(ValueError, match=f"gate {key} must be finite and in"):
        thresholds(**{key: value})


def test_only_task_losses_count():
    others = without(PASSING, *[k for k in PASSING if k.startswith("task.")]) | {
        "task.mean.loss_points": 0.0,
        "switches.s8.boolq.loss_points": 0.0,
        "task.mean.max_loss_points": 0.0,
    }
    assert statuses(others)[3] == "MISSING"


def _handoff(routed: float, reprefill: float, same: float | None = None) -> dict:
    """A scored item (boolq, every session right) with these TTFTs: a mapped handoff, sampled when `same` is given."""
    ttft = {"routed": routed, "reprefill": reprefill} | ({"same_work": same} if same is not None else {})
    right = [[-0.1, 1.0], [-2.0, 0.0]]
    scores = dict.fromkeys(("routed", "native_target", "native_source"), right)
    row = {"task": "boolq", "label": 0, "lengths": [2, 3], "history_tokens": 80, "turn_tokens": 10, "scores": scores}
    return row | {"ttft": ttft, "handoff": {"path": "map", "prefill_fraction": 0.0}}


def test_backfill_gives_older_records_the_latency_ci_and_same_work():
    """From the per-item TTFTs, resampled as the run's own CIs (`eval.tasks.n_boot`, `seed`); logged metrics win, a
    record without those params gets no CI (its latency then says "no CI logged")."""
    items = [_handoff(10.0, 30.0 + i, same=29.0 + i if i % 4 == 0 else None) for i in range(20)]
    params = {"eval.tasks.n_boot": "500", "seed": "0"}
    found = backfill({}, items, params)
    assert found["ttft_speedup"] == pytest.approx(3.95)
    assert found["ttft_speedup_low"] <= found["ttft_speedup"] <= found["ttft_speedup_high"]
    assert found["ttft.same_work_items"] == 5.0 and found["ttft.same_work_ratio"] == pytest.approx(30.0 / 29.0, 1e-2)
    assert backfill({"ttft_speedup_low": 9.0}, items, params)["ttft_speedup_low"] == 9.0
    assert "ttft_speedup_low" not in backfill({}, items, {})


# --- check over an MLflow store -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('gate') / 'mlflow.db'}"


@pytest.fixture
def experiment(uri) -> str:
    name = f"gate_{next(_names)}"
    mlflow.set_tracking_uri(uri)
    mlflow.create_experiment(name)
    return name


def plant(uri: str, experiment: str, metrics: dict, tags: dict, status: str = "FINISHED") -> str:
    """One run with these metrics and tags, started after every earlier planted run; returns its id."""
    client = MlflowClient(uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    start = next(_clock)
    run = client.create_run(experiment_id, start_time=start, tags=tags, run_name=f"planted_{next(_names)}")
    client.log_batch(run.info.run_id, metrics=[Metric(k, v, start, 0) for k, v in metrics.items()])
    client.set_terminated(run.info.run_id, status, start + 1)
    return run.info.run_id


def gate(uri: str, experiment: str, **kwargs) -> int:
    return check(uri, experiment, None, 2.0, 1.0, **kwargs)


def test_missing_experiment_or_runs_fail(uri, experiment, capsys):
    assert gate(uri, "no_such_experiment") == 1
    plant(uri, experiment, PASSING, REAL | {"job": "fit_eval"})  # not a routed run
    plant(uri, experiment, PASSING, REAL, status="RUNNING")  # not finished
    assert gate(uri, experiment) == 1
    assert "no finished routed runs" in capsys.readouterr().out


def test_a_planted_passing_run_passes_and_a_random_one_fails(uri, experiment, capsys):
    good = plant(uri, experiment, PASSING, REAL)
    assert gate(uri, experiment) == 0
    out = capsys.readouterr().out
    assert "fewshot · small_to_large · histories any length: PASS — run planted" in out and good[:8] in out
    assert out.rstrip().endswith("gate: PASS") and "MISSING" not in out
    plant(uri, experiment, PASSING | {"ttft_speedup": 50.0}, REAL | {"weights": "random", "workload": "passage"})
    assert gate(uri, experiment) == 1
    assert "passage · small_to_large · histories any length: FAIL" in capsys.readouterr().out


def test_summary_is_one_table_and_the_engine_is_an_operating_point(uri, experiment, capsys):
    """--summary ends with one row per judged group; a run on the static engine is judged beside the HF run of the
    same workload, never shadowing it."""
    plant(uri, experiment, PASSING, REAL)
    plant(uri, experiment, PASSING | {"ttft_speedup_low": 1.1, "ttft_speedup_high": 1.5}, REAL | {"engine": "graph"})
    assert gate(uri, experiment, summary=True) == 1
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| fewshot")]
    assert len(table) == 2, out
    hf, graph = sorted(table, key=lambda line: "engine graph" in line)
    assert hf.endswith("| PASS |") and "PASS: " in hf and "engine" not in hf
    assert "engine graph" in graph and "| FAIL: 3.00× [1.10, 1.50]" in graph and graph.endswith("| FAIL |")
    assert out.index("| workload | direction | operating point | routed workload run | latency |") < out.index(
        "gate: FAIL"
    )


def test_the_latest_run_is_judged_not_the_best(uri, experiment, capsys):
    best = plant(uri, experiment, PASSING, REAL)
    lost = {"task.mmlu.loss_points": 4.0, "task.mmlu.loss_points_low": 2.0, "task.mmlu.loss_points_high": 6.0}
    latest = plant(uri, experiment, PASSING | lost, REAL)
    assert gate(uri, experiment) == 1
    assert f"({latest[:8]}" in capsys.readouterr().out
    assert gate(uri, experiment, run=best) == 0  # the operating point named explicitly
    assert gate(uri, experiment, run="0" * 32) == 1


def test_a_later_validation_run_does_not_shadow_the_reported_one(uri, experiment, capsys):
    """The grid that chooses a lever runs after the reported run: the gate still judges the test-item run; with
    only validation runs it refuses (FAIL), never passes."""
    reported = plant(uri, experiment, PASSING, REAL)
    plant(uri, experiment, PASSING | {"task.mmlu.loss_points": 4.0}, REAL | {"split": "valid"})
    assert gate(uri, experiment) == 0
    out = capsys.readouterr().out
    assert f"({reported[:8]}" in out and "1 on validation items not judged" in out


def test_history_regime_is_the_longest_timed_bucket():
    assert history_regime({"ttft.routed.le_512_ms_p50": 1.0, "ttft.routed.le_2048_ms_p50": 2.0}) == "≤ 2048 tokens"
    assert history_regime({"ttft.routed.le_512_ms_p95": 1.0, "ttft.routed.gt_32768_ms_p50": 2.0}) == "> 32768 tokens"
    assert history_regime({"ttft.routed_ms_p50": 1.0}) == "any length"


def test_a_run_on_longer_histories_does_not_shadow_shorter_ones(uri, experiment, capsys):
    """100-shot histories pass latency where short ones fail: each length is its own operating point, judged on its
    latest run, and the gate passes only when every one does."""
    plant(uri, experiment, PASSING | SLOW | {"ttft.routed.le_512_ms_p50": 9.0}, REAL)
    plant(uri, experiment, PASSING | {"ttft.routed.le_8192_ms_p50": 12.0}, REAL)
    assert gate(uri, experiment) == 1
    out = capsys.readouterr().out
    assert "histories ≤ 512 tokens: FAIL" in out and "histories ≤ 8192 tokens: PASS" in out


def test_a_run_of_another_policy_does_not_shadow_the_map_run(uri, experiment, capsys):
    """A cost-aware session (`policy=auto`) that re-prefilled most handoffs is another operating point: the latest
    pure-transfer run keeps its own verdict."""
    plant(uri, experiment, PASSING | SLOW, REAL)
    plant(uri, experiment, PASSING, REAL | {"policy": "auto"})
    assert gate(uri, experiment) == 1
    out = capsys.readouterr().out
    assert "histories any length: FAIL" in out and "histories any length, policy auto: PASS" in out


def test_only_validation_runs_never_pass(uri, experiment):
    plant(uri, experiment, PASSING, REAL | {"split": "valid"})
    assert gate(uri, experiment) == 1


def test_every_workload_and_direction_must_pass(uri, experiment, capsys):
    plant(uri, experiment, PASSING, REAL)
    plant(uri, experiment, PASSING | {"rollback_verified": 0.0}, REAL | {"direction": "large_to_small"})
    assert gate(uri, experiment) == 1
    out = capsys.readouterr().out
    assert "small_to_large · histories any length: PASS" in out and "large_to_small · histories any length: FAIL" in out


def test_parent_filter(uri, experiment):
    parent = plant(uri, experiment, {}, {"job": "sweep"})
    plant(uri, experiment, PASSING, REAL | {"mlflow.parentRunId": parent})
    plant(uri, experiment, PASSING | SLOW, REAL | {"direction": "large_to_small"})
    assert gate(uri, experiment) == 1
    assert check(uri, experiment, parent) == 0  # thresholds from conf/gate/default.yaml


def test_cli_and_hydra_job_exit_status(uri, experiment, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from src.run import main

    plant(uri, experiment, PASSING, REAL)
    failing = f"{experiment}_failing"
    MlflowClient(uri).create_experiment(failing)
    plant(uri, failing, PASSING | {"ttft_speedup": 1.5, "ttft_speedup_low": 1.4, "ttft_speedup_high": 1.6}, REAL)
    done = subprocess.run(
        [sys.executable, "-m", "src.gate", "--experiment", failing, "--uri", uri, "--min-speedup", "1.2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr  # the CLI's thresholds: 1.5× passes 1.2×
    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path / "home"))
    for name, status in ((experiment, 0), (failing, 1), ("absent", 1)):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("run", overrides=["+experiment=gate", f"gate.experiment={name}", f"tracking.uri={uri}"])
        with pytest.raises(SystemExit) as exit_info:
            main.__wrapped__(cfg)
        assert exit_info.value.code == status, name


def test_a_run_that_logged_infinity_fails_the_gate(uri, experiment, capsys):
    """MLflow stores +inf as DBL_MAX: read back, it must still never pass (MISSING)."""
    plant(uri, experiment, PASSING | {"ttft_speedup": INF, "ttft_speedup_low": INF, "ttft_speedup_high": INF}, REAL)
    assert gate(uri, experiment) == 1
    assert "MISSING      latency: end-to-end TTFT speedup" in capsys.readouterr().out


def test_a_run_without_a_split_tag_is_refused(uri, experiment, capsys):
    plant(uri, experiment, PASSING, without(REAL, "split"))
    assert gate(uri, experiment) == 1
    out = capsys.readouterr().out
    assert "MISSING      routed workload run" in out and "split=— (no split tag)" in out
    plant(uri, experiment, PASSING, REAL)  # a test run of the same (workload, direction) is judged, the other refused
    assert gate(uri, experiment) == 0
    assert "1 without a split tag refused" in capsys.readouterr().out


@pytest.mark.parametrize(("key", "value"), [("min_speedup", NAN), ("max_loss", -1.0), ("max_prefill_fraction", 2.0)])
def test_an_impossible_threshold_is_refused_before_any_run_is_read(key, value, tmp_path):
    with pytest.raises(ValueError, match="must be finite and in"):
        check(f"sqlite:///{tmp_path / 'never.db'}", "routed", **{key: value})
    assert not (tmp_path / "never.db").exists()  # the store was never opened


def test_a_damaged_items_artifact_is_named(uri, experiment):
    run_id = plant(uri, experiment, without(PASSING, "ttft.same_work_ratio"), REAL)
    MlflowClient(uri).log_text(run_id, '{"items": [{"ttft": ', "routed/items.json")
    with pytest.raises(RecordError, match=r"routed/items\.json: not valid JSON, truncated or damaged"):
        gate(uri, experiment)
    MlflowClient(uri).log_text(run_id, '{"rows": []}', "routed/items.json")
    with pytest.raises(RecordError, match=r"routed/items\.json: no 'items'"):
        gate(uri, experiment)


def test_cli_names_an_impossible_threshold(uri, experiment):
    done = subprocess.run(
        [sys.executable, "-m", "src.gate", "--experiment", experiment, "--uri", uri, "--max-loss-points", "nan"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "gate max_loss_points must be finite" in done.stderr
    assert "Traceback" not in done.stderr
