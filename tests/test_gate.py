"""The promotion gate on hand-made routed runs (tests/gate_records.py): a consistent passing run passes, and each record
the audit of issue 32 built gets the right verdict — a CI of [0, 0] with no disagreement, 3 items per task, logged
metrics the items contradict, zero items with a logged CI, a rollback flag against its refusal kinds, a speedup
outside its own CI, multi-turn turns as independent, a harness median without a count — as do the earlier ones:
validation items, random weights, non-finite or missing measurements, impossible thresholds. The decision over many
runs (a de-tagged shard, a re-run to PASS, bf16 200-shot beside fp32 100-shot) is in tests/test_gate_plan.py."""

import math
import sys

import pytest

from src.gate_criteria import Paired, Thresholds, decide_task, judge_run, still_needed, thresholds
from src.gate_evidence import evidence, is_shard
from src.records import RecordError
from tests.gate_records import KINDS, PARAMS, REAL, logged, passing, row, run, task_rows

LIMITS = Thresholds(
    min_speedup=2.0,
    max_loss_points=5.0,  # a 5-point margin: 100 items per task can pass (1 point needs ≈ 400, test below)
    max_harness_skew=1.25,
    max_prefill_fraction=0.5,
    min_task_units=30,
    min_timed_units=20,
    planned_loss_points=0.0,
    power=0.8,
)
ORDER = ("routed", "record", "latency", "harness", "quality", "prefill", "rollback")


def statuses(planted, limits: Thresholds = LIMITS) -> list[str]:
    return [v.status for v in judge_run(planted, limits)]


def verdict(planted, name: str, limits: Thresholds = LIMITS):
    (found,) = [v for v in judge_run(planted, limits) if v.criterion.startswith(name)]
    return found


def expect(**changes: str) -> list[str]:
    """Every criterion PASS but the named ones (routed, record, latency, harness, quality, prefill, rollback)."""
    return [changes.get(name, "PASS") for name in ORDER]


# --- a consistent run ------------------------------------------------------------------------------------------------


def test_a_planted_passing_run_passes():
    verdicts = judge_run(run(passing()), LIMITS)
    assert [v.status for v in verdicts] == expect() and all(v.passed for v in verdicts)
    quality = verdicts[ORDER.index("quality")].measured
    assert "arc_easy +0.00 [-3.70, +3.70] on 100 items (0 differ)" in quality and "mean +0.00" in quality
    assert "3.00× [3.00, 3.00] on 200 handoffs" in verdicts[ORDER.index("latency")].measured
    assert "86 logged metrics equal their recomputation from 200 rows" in verdicts[ORDER.index("record")].measured


def test_at_the_yaml_margin_a_pass_needs_about_400_items_per_task():
    """1 point: with no item differing, 420 items per task clear it; 300 do not (a [0, 0] bootstrap CI would)."""
    assert statuses(run(passing(420)), thresholds()) == expect()
    assert statuses(run(passing(300)), thresholds())[ORDER.index("quality")] == "UNDERPOWERED"


# --- the audit's hand-made records -----------------------------------------------------------------------------------


def test_a_ci_of_zero_with_no_disagreement_is_underpowered():
    """20 items per task, none differs: the run's own bootstrap CI is [0, 0] and the record is consistent, but 20
    items cannot show a loss below the margin — Tango's interval is ±16 points."""
    planted = run(passing(20))
    assert planted.metrics["task.arc_easy.loss_points_low"] == planted.metrics["task.arc_easy.loss_points_high"] == 0
    assert statuses(planted) == expect(harness="UNDERPOWERED", quality="UNDERPOWERED")  # 5 sampled, 20 needed
    quality = verdict(planted, "quality").measured
    assert "arc_easy +0.00 [-16.11, +16.11] on 20 items (0 differ) (below the 30-unit minimum;" in quality


@pytest.mark.parametrize(("n", "lost"), [(3, 0), (3, 3), (25, 25)])
def test_few_items_per_task_never_decide(n, lost):
    """Not a PASS on 3 agreeing items, and not a FAIL on 3 — or 25 — lost ones either (the exact test alone would
    FAIL 25 of 25 lost): below min_task_units, UNDERPOWERED."""
    items = task_rows("arc_easy", n, lost=lost) + task_rows("boolq", n, lost=lost)
    assert verdict(run(items), "quality").status == "UNDERPOWERED"
    assert decide_task(Paired(lost=30, gained=0, rows=30, units=30), LIMITS).status == "FAIL"  # at the minimum


def test_logged_metrics_the_items_contradict_fail_naming_both():
    """The metric says prefill fraction 0, the handoff records say every handoff re-prefilled."""
    items = [item | {"handoff": item["handoff"] | {"path": "reprefill", "prefill_fraction": 1.0}} for item in passing()]
    planted = run(items, metrics=logged(items) | {"prefill_fraction": 0.0})
    assert statuses(planted) == expect(record="FAIL", latency="FAIL", harness="FAIL", prefill="FAIL")
    assert "logged prefill_fraction = 0, the items give 1" in verdict(planted, "record").measured
    lost = run(passing(), metrics=logged(passing()) | {"task.boolq.loss_points": -5.0})  # the logged loss, edited
    assert "logged task.boolq.loss_points = -5, the items give 0" in verdict(lost, "record").measured


def test_zero_items_with_a_logged_ci_fail():
    metrics = logged(passing(), []) | {"task.mean.loss_points_low": 0.0}
    planted = run([], metrics=metrics, moves=[])
    assert statuses(planted) == ["PASS", "FAIL", "MISSING", "MISSING", "MISSING", "MISSING", "PASS"]
    assert "logged task.arc_easy.loss_points_low = 0, the items give none" in verdict(planted, "record").measured
    assert verdict(planted, "quality").measured == "the items artifact holds no scored item"


def test_a_rollback_flag_against_its_refusal_kinds_fails():
    items = passing()
    flagged = run(items, metrics=logged(items) | {"rollback.nonfinite_map": 0.0})
    flagged.metrics["rollback.beyond_length"] = 0.0
    found = verdict(flagged, "rollback")
    assert found.status == "FAIL"
    assert found.measured == "rollback_verified = 1 contradicts rollback.beyond_length = 0, rollback.nonfinite_map = 0"
    quiet = run(items, metrics={k: v for k, v in flagged.metrics.items() if k != "rollback_verified"})
    assert verdict(quiet, "rollback").measured == "broken: rollback.beyond_length = 0, rollback.nonfinite_map = 0"
    held = {k: v for k, v in logged(items).items()} | {"rollback_verified": 0.0}
    assert verdict(run(items, metrics=held), "rollback").measured.startswith("rollback_verified = 0 contradicts all 5")
    bare = {k: v for k, v in held.items() if not k.startswith("rollback.")} | {"rollback_verified": 1.0}
    assert verdict(run(items, metrics=bare), "rollback").status == "MISSING"  # a flag without the kinds it sums up


def test_a_speedup_outside_its_own_ci_fails():
    items = passing()
    metrics = logged(items) | {"ttft_speedup_low": 1.2, "ttft_speedup_high": 1.9}
    record = verdict(run(items, metrics=metrics), "record").measured
    assert "outside its own CI [1.2, 1.9]" in record and "logged ttft_speedup_low = 1.2, the items give 2.99" in record
    alone = run(items, metrics=metrics)
    no_items = evidence("n", "i", 0, alone.metrics, alone.params, alone.tags, None, "nowhere")  # no artifact at all
    assert statuses(no_items)[:5] == ["PASS", "FAIL", "MISSING", "MISSING", "MISSING"]


def _conversations(n: int, turns: int, lost_in: int = 0, key: str | None = "conversation") -> list[dict]:
    """n conversations of `turns` turns per task; the first `lost_in` conversations lose every turn (clustered)."""
    rows = []
    for task in ("arc_easy", "boolq"):
        for c in range(n):
            for t in range(turns):
                extra = {key: f"{task}#{c}"} if key else {}
                rows.append(row(task, c * turns + t, native=True, routed=c >= lost_in, **extra))
    return rows


def test_multiturn_turns_are_never_resampled_as_independent():
    """Turns that do not say their conversation are refused; turns that do are judged per conversation, with the
    design effect of their clustering."""
    tags = REAL | {"workload": "multiturn"}
    untold = run(_conversations(40, 8, key=None), tags=tags)
    assert verdict(untold, "quality").status == "MISSING"
    assert "do not say their 'conversation'" in verdict(untold, "quality").measured
    assert verdict(untold, "latency:").status == "MISSING"
    clustered = run(_conversations(40, 8, lost_in=1), tags=tags)
    quality = verdict(clustered, "quality", thresholds())
    assert "320 turns in 40 conversations (8 differ, design effect 8.18)" in quality.measured
    assert "on 80 conversations" in verdict(clustered, "latency:").measured  # 40 per task
    as_items = run(_conversations(40, 8, lost_in=1), tags=REAL)  # the same rows read as 320 items each
    assert "on 320 items (8 differ)" in verdict(as_items, "quality", thresholds()).measured


def test_rows_that_score_an_item_twice_are_refused():
    items = passing()
    found = verdict(run(items + items[:3]), "quality")
    assert found.status == "MISSING" and "3 rows score an item already scored" in found.measured


def test_a_harness_median_without_a_count_fails_against_the_items():
    items = [item | {"ttft": {k: v for k, v in item["ttft"].items() if k != "same_work"}} for item in passing()]
    metrics = logged(items) | {"ttft.same_work_ratio": 1.0}
    planted = run(items, metrics=metrics)
    assert statuses(planted) == expect(record="FAIL", harness="MISSING")
    assert "logged ttft.same_work_ratio = 1, the items give none" in verdict(planted, "record").measured


def test_the_harness_needs_a_count_and_an_interval_inside_the_band():
    def sampled(every: int, skew: float, spread: float = 0.001) -> list[dict]:
        items = task_rows("arc_easy", 100) + task_rows("boolq", 100)
        inside = lambda i, item: item["ttft"]["reprefill"] / skew / (1 + spread * (i % 5 - 2))  # ratios skew·(1 ± …)
        return [
            item | {"ttft": item["ttft"] | {"same_work": inside(i, item)}} if i % every == 0 else item
            for i, item in enumerate(items)
        ]

    assert verdict(run(sampled(8, 1.0)), "latency harness").status == "PASS"  # 25 sampled, ≈ 1×
    few = verdict(run(sampled(20, 1.0)), "latency harness")
    assert few.status == "UNDERPOWERED" and "on 10 re-prefilled handoffs: fewer than 20" in few.measured
    assert verdict(run(sampled(8, 1.82)), "latency harness").status == "FAIL"  # the auto run's clock
    assert verdict(run(sampled(8, 1.25, spread=0.05)), "latency harness").status == "UNDERPOWERED"  # on the edge


# --- latency ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("speedup", "n", "expected"),
    [(3.0, 100, "PASS"), (1.5, 100, "FAIL"), (3.0, 8, "UNDERPOWERED"), (2.0, 100, "UNDERPOWERED")],
    ids=["fast", "slow", "few-handoffs", "on-the-line"],
)
def test_latency_is_the_median_speedup_with_its_interval(speedup, n, expected):
    items = task_rows("arc_easy", n, speedup=speedup) + task_rows("boolq", n, speedup=speedup)
    assert verdict(run(items), "latency:").status == expected


def test_latency_reads_non_finite_ttfts_and_missing_handoffs_as_missing():
    items = passing()
    items[3] = items[3] | {"ttft": items[3]["ttft"] | {"routed": 0.0}}
    assert verdict(run(items), "latency:").measured == "a TTFT of 0 or NaN: not every ratio is finite"
    untimed = [item | {"ttft": {}} for item in passing()]
    assert verdict(run(untimed), "latency:").measured == "no handoff timed on both paths"
    assert verdict(run(passing(), moves=[]), "latency:").status == "MISSING"  # no handoff records: no prefill fraction


def test_a_run_that_re_prefilled_most_of_the_history_is_no_transfer():
    items = [item | {"handoff": item["handoff"] | {"prefill_fraction": 0.6}} for item in passing()]
    planted = run(items)
    assert statuses(planted) == expect(latency="FAIL", prefill="FAIL")
    assert "but 0.60 of the prefill spent: not a transfer" in verdict(planted, "latency:").measured


# --- tags, weights, thresholds ---------------------------------------------------------------------------------------


def test_validation_items_or_no_split_are_never_judged_as_test():
    assert statuses(run(passing(), tags=REAL | {"split": "valid"})) == expect(routed="FAIL")
    untagged = {k: v for k, v in REAL.items() if k != "split"}
    assert statuses(run(passing(), tags=untagged)) == expect(routed="MISSING")
    assert "split=— (no split tag)" in verdict(run(passing(), tags=untagged), "routed").measured


@pytest.mark.parametrize("weights", ["random", None, "Real"])
def test_random_weight_runs_never_pass_quality(weights):
    tags = REAL | {"weights": weights} if weights else {k: v for k, v in REAL.items() if k != "weights"}
    assert verdict(run(passing(), tags=tags), "quality").status == "MISSING"


def test_an_underpowered_task_says_how_many_more_items_a_stated_effect_needs():
    """From the planned loss (0: the map loses nothing) at the run's share of differing items, at 80 % power — not from
    the observed loss: two runs with the same discordance and opposite observed losses need the same items."""
    better, worse = Paired(lost=2, gained=8, rows=100, units=100), Paired(lost=8, gained=2, rows=100, units=100)
    assert still_needed(better, thresholds()) == still_needed(worse, thresholds()) == 7893 - 100
    none_differ = Paired(lost=0, gained=0, rows=100, units=100)
    assert still_needed(none_differ, thresholds()) == 281  # ≈ the rule of three's 300 in all, at 80 % power
    clustered = Paired(lost=8, gained=2, rows=100, units=25, design_effect=2.0)
    assert still_needed(clustered, thresholds()) == math.ceil(7893 * 2.0 / 4) - 25  # in conversations
    found = verdict(run(passing(100, lost=3)), "quality", thresholds())
    assert "arc_easy +3.00 [-0.81, +8.45] on 100 items (3 differ) (≈ 2410 more items for 80% power" in found.measured


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_harness_skew", 0.8),
        ("max_loss_points", -1.0),
        ("max_loss_points", math.nan),
        ("min_speedup", 0.5),
        ("min_speedup", math.inf),
        ("max_prefill_fraction", 1.5),
        ("min_task_units", 0),
        ("min_timed_units", math.nan),
        ("planned_loss_points", 2.0),  # at or past the margin: nothing to plan for
        ("power", 0.3),
    ],
)
def test_a_threshold_that_cannot_hold_is_a_clear_error(key, value):
    with pytest.raises(ValueError, match=f"gate {key} must be"):
        thresholds(**{key: value})


def test_a_run_that_logged_infinity_is_missing_not_passed():
    """MLflow stores +inf as DBL_MAX: read back, a rollback kind at DBL_MAX is no measurement."""
    items = passing()
    metrics = logged(items) | {"rollback.failed_guard": sys.float_info.max}
    assert verdict(run(items, metrics=metrics), "rollback").status == "MISSING"


# --- what a record must hold -----------------------------------------------------------------------------------------


def test_a_damaged_items_document_is_named():
    with pytest.raises(RecordError, match=r"x/items\.json: no 'items'"):
        evidence("n", "i", 0, {}, PARAMS, REAL, {"rows": []}, "x/items.json")
    broken = {"items": [{k: v for k, v in row("boolq", 0, True, True).items() if k != "lengths"}]}
    with pytest.raises(RecordError, match=r"x/items\.json: item row 0 lacks one of"):
        evidence("n", "i", 0, {}, PARAMS, REAL, broken, "x/items.json")
    moves = {"items": [], "handoffs": [{"sender": "source"}]}
    with pytest.raises(RecordError, match=r"handoff record 0 lacks one of"):
        evidence("n", "i", 0, {}, PARAMS, REAL, moves, "x/items.json")


@pytest.mark.parametrize(
    ("tags", "params", "shard"),
    [
        ({"shard": "0/2"}, {}, True),
        ({}, {"workload.shards": "2", "workload.shard": "0"}, True),  # the shard tag removed: still a shard
        ({}, {"workload.shards": "2", "workload.shard": "all"}, False),  # the joined run (src/routed_merge.py)
        ({}, {"workload.shards": "1", "workload.shard": "0"}, False),
        ({}, {}, False),
    ],
)
def test_a_shard_is_a_shard_by_its_params_too(tags, params, shard):
    assert is_shard(tags, params) == shard


def test_every_rollback_kind_the_job_replays_is_read():
    assert {f"rollback.{kind}" for kind in KINDS} <= set(logged(passing(), []))
