"""The routed job (src/routed.py, src/routed_runs.py, src/routed_multiturn.py, src/routed_rollback.py): on the exact
pair (tests/exact_pair.py, both directions) the routed session's scores equal the all-re-prefill session's for every
runner — and a wrong mapper's do not, so no native state leaks into the routed path —, the rollback replay verifies
every refusal kind, the metrics are computed from the per-item rows, and `routed(cfg)` runs end to end on the tiny
random pair into MLflow, where the gate refuses it (random weights carry no quality evidence)."""

import copy
import gc
import json
import math
import time
import warnings
import weakref
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from src.length_evidence import evidence
from src.models import fingerprint
from src.routed import handoffs, median_ci, paired_gain, quality, speedup_ci, timing
from src.routed_multiturn import multiturn
from src.routed_rollback import rollback
from src.routed_runs import Run, bucket, single_turn, switches
from src.runtime.routing import Policy, RouteRefusedWarning, bind
from src.tasks import Item, load_task
from src.workloads import Bytes, Example
from tests.exact_pair import exact_pair
from tests.test_length_evidence import UNSAVED, measured, with_evidence

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared/data"
EXAMPLES = [
    Example("The cat sat on the mat. It was warm and", Item("piqa", 0, [" the cat"] * 2, [" slept", " ran"], 0)),
    Example("Rain fell all day; the river", Item("winogrande", 1, [" rose so", " fell so"], [" it flooded"] * 2, 1)),
    Example("A B C D E F G H I J K L M N O P", Item("lambada", 2, [" Q R"], [" S"], 0)),
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine (conftest.one_thread)."""


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=1)


def run_of(pair, mapper=None, every: int = 2, **policy) -> Run:
    """The exact pair's run; every `every`-th scored item times the same work in the routed session."""
    exact = pair.exact
    inverse = replace(
        exact,
        weight_k=torch.linalg.inv(exact.weight_k.double()).float(),
        weight_v=torch.linalg.inv(exact.weight_v.double()).float(),
        manifest=exact.manifest
        | {"source_fingerprint": exact.manifest["target_fingerprint"]}
        | {"target_fingerprint": exact.manifest["source_fingerprint"]},
    )
    routes = {
        ("source", "target"): bind(pair.source, pair.target, mapper or exact, pair.tokenizer_hash),
        ("target", "source"): bind(pair.target, pair.source, inverse, pair.tokenizer_hash),
    }
    models = {"source": pair.source, "target": pair.target}
    return Run(models, routes, Policy(**policy), Bytes(96), warmup=1, same_work_every=every)


def test_single_turn_on_engines_uses_them_for_every_path(pair, monkeypatch):
    """With engines, the routed session, the all-re-prefill session (its hit too) and the same-work twin each run
    on their own kind's engines — both sides of every ratio on the same runtime — and score as the HF sessions do."""
    from src.runtime.engine import Engine

    run = run_of(pair)
    run.engines = {kind: {n: Engine(m, 128) for n, m in run.models.items()} for kind in ("routed", "reprefill", "twin")}
    forwards = {kind: 0 for kind in run.engines}
    for kind, engines in run.engines.items():
        for engine in engines.values():
            original = engine.forward

            def counted(*args, kind=kind, original=original, **kwargs):
                forwards[kind] += 1
                return original(*args, **kwargs)

            monkeypatch.setattr(engine, "forward", counted)
    rows, _ = single_turn(run, EXAMPLES)
    assert all(count > 0 for count in forwards.values()), forwards  # routed, re-prefill + hit, twin
    reference, _ = single_turn(run_of(pair), EXAMPLES)
    for got, want in zip(rows, reference, strict=True):
        for mode in ("routed", "native_target"):
            assert np.allclose(got["scores"][mode], want["scores"][mode], atol=1e-4), mode


def test_warm_up_turns_leave_no_cost_behind(pair):
    """The `auto` policy's cost lines fit measured turns only: the warm-up's timings (kernel compilation, first
    allocations) are forgotten, so a run with warm-up observes exactly what a run without it does (policy `map`:
    the same paths every run, where `auto` would choose by the clock)."""
    observed = []
    for warmup in (0, 2):
        run = replace(run_of(pair), warmup=warmup)
        single_turn(run, EXAMPLES)
        observed.append({key: len(samples) for key, samples in run.costs.samples.items()})
    assert observed[0] == observed[1] and observed[0][("target", "prefill")] >= len(EXAMPLES)


def test_the_warm_up_captures_every_engines_graphs_before_a_timed_turn(pair):
    """A bucket first used in a scored turn was captured inside its clock (H100, 2026-12-06: 21 of 800 turns at
    53.5 / 64.2 ms against 8.0 / 3.9): the end of the warm-up captures every engine's buckets, every kind's."""
    captured = []
    spy = lambda name: type("Spy", (), {"capture_all": lambda self: captured.append(name) or 0})()
    run = replace(run_of(pair), engines={k: {m: spy(f"{k}/{m}") for m in ("source", "target")} for k in ("a", "b")})
    run.warmed()
    assert sorted(captured) == ["a/source", "a/target", "b/source", "b/target"]


def scores(rows, mode):
    return np.array([s[0] for row in rows for s in row["scores"][mode]])


def test_single_turn_routed_equals_native_on_the_exact_pair_only(pair):
    rows, records = single_turn(run_of(pair), EXAMPLES)
    assert [row["index"] for row in rows] == [0, 1, 2] and len(records) == 3
    assert all(r["path"] == "map" and r["mapped"] == r["context"] for r in records)
    assert np.allclose(scores(rows, "routed"), scores(rows, "native_target"), atol=1e-3)
    assert not np.allclose(scores(rows, "native_source"), scores(rows, "native_target"), atol=1e-2)
    sampled, plain = {"routed", "reprefill", "hit", "same_work"}, {"routed", "reprefill", "hit"}
    assert [set(row["ttft"]) for row in rows] == [sampled, plain, sampled]  # every 2nd scored item: the same work too
    wrong, _ = single_turn(run_of(pair, pair.wrong), EXAMPLES)
    assert not np.allclose(scores(wrong, "routed"), scores(wrong, "native_target"), atol=1e-2)
    assert np.allclose(scores(wrong, "native_target"), scores(rows, "native_target"), atol=1e-5)
    held = run_of(pair, pair.wrong, levers=replace(Policy().levers, native_sink=2, hold_back=3))
    rows, records = single_turn(held, EXAMPLES[:1])
    assert (records[0]["mapped"], records[0]["prefilled"]) == (rows[0]["history_tokens"] - 5, 5)


def test_switches_and_multiturn_on_the_exact_pair(pair):
    last, records, per_count = switches(run_of(pair), EXAMPLES[:2], [1, 2, 4])
    assert sorted(per_count) == [1, 2, 4] and last == per_count[4]
    for rows in per_count.values():
        assert np.allclose(scores(rows, "routed"), scores(rows, "native_target"), atol=1e-3)
    handoff = [r for r in records if r["sender"] not in (None, r["receiver"])]
    assert len(handoff) == 2 * (1 + 2 + 4)  # s handoffs per item and switch count
    assert {r["sender"] for r in handoff} == {"source", "target"}
    if not (DATA / "eval").is_dir():
        pytest.skip("shared data not found")
    escalation = OmegaConf.create({"policy": "schedule", "every": 2, "threshold": 0.0})
    rows, records, turns, replays = multiturn(run_of(pair), DATA, ["arc_easy"], 4, 2, escalation)
    assert turns == len(rows) == 4 and [row["escalated"] for row in rows] == [False, True] * 2
    assert np.allclose(scores(rows, "routed"), scores(rows, "native_target"), atol=1e-3)
    assert [r["path"] for r in records if r["sender"] not in (None, r["receiver"])] == ["map"] * 2
    assert replays and all(turn.numel() for _, turn in replays)
    metrics = handoffs(records, turns)
    assert metrics["handoff_frequency"] == 0.5 and metrics["prefill_fraction"] == 0.0
    unsure = OmegaConf.create({"policy": "confidence", "every": 0, "threshold": 1.01})  # every pick is below 1.01
    rows, records, _, _ = multiturn(run_of(pair), DATA, ["piqa"], 2, 2, unsure)
    assert [row["escalated"] for row in rows] == [True, True]
    assert np.allclose(scores(rows, "routed"), scores(rows, "native_target"), atol=1e-3)
    escalations = [r for r in records if r["sender"] == "source" and r["receiver"] == "target"]
    assert len(escalations) == 2 and all(r["turn"] == 0 and r["path"] == "map" for r in escalations)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollback_replay_verifies_every_kind(pair, dtype):
    """Every refusal kind falls back bit for bit — in bf16 too, the dtype a server runs (on CPU: a GPU run that broke
    it, BENCHMARKS § rollback, is not reproduced here) — and the planted refusal at binding leaves no route warning in
    the run's log (a log that says "every handoff on it re-prefills" of a run whose handoffs all mapped misleads)."""
    mapper = pair.exact
    if dtype != torch.float32:  # the models and the mapper's fingerprints in bf16, as a bf16 fit records them
        pair = pair._replace(source=copy.deepcopy(pair.source).to(dtype), target=copy.deepcopy(pair.target).to(dtype))
        fingerprints = {"source_fingerprint": fingerprint(pair.source), "target_fingerprint": fingerprint(pair.target)}
        mapper = replace(mapper, manifest=mapper.manifest | fingerprints)
    run = run_of(pair)
    replays = [(run.encode(ex.history), run.groups(ex.item)[0][0]) for ex in EXAMPLES[:2]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checks = rollback(run, mapper, replays, 3, (pair.tokenizer_hash,))
    assert not [w for w in caught if issubclass(w.category, RouteRefusedWarning)]
    kinds = ("artifact_mismatch", "nonfinite_map", "nonfinite_source", "beyond_length", "failed_guard")
    verified = {f"rollback.{kind}{end}": 1.0 for kind in kinds for end in ("", ".refused", ".tokens_equal")}
    diffs = {f"rollback.{kind}.cache_max_abs_diff": 0.0 for kind in kinds}
    assert checks == verified | diffs | {"rollback_verified": 1.0}


def test_a_rollback_kind_refused_for_another_reason_is_not_verified(pair):
    """A replay counts only a refusal for its kind's own reason. A mapper of other models than the run's (here:
    fingerprinted before a cast to bf16) is refused when bound, so every kind's replay re-prefills bit for bit — but
    only the planted mismatch tested its own refusal: the other kinds do not hold, and their binding refusals warn."""
    cast = pair._replace(source=copy.deepcopy(pair.source).to(torch.bfloat16),
                         target=copy.deepcopy(pair.target).to(torch.bfloat16))  # fmt: skip
    run = run_of(cast)
    replays = [(run.encode(EXAMPLES[0].history), run.groups(EXAMPLES[0].item)[0][0])]
    with pytest.warns(RouteRefusedWarning, match="source fingerprint"):
        checks = rollback(run, pair.exact, replays, 3, (pair.tokenizer_hash,))
    assert checks["rollback.artifact_mismatch"] == 1.0 and checks["rollback_verified"] == 0.0
    assert checks["rollback.failed_guard"] == checks["rollback.failed_guard.refused"] == 0.0
    assert checks["rollback.failed_guard.tokens_equal"] == 1.0  # re-prefilled bit for bit — for the wrong reason


def test_a_mapper_verified_for_shorter_histories_still_gets_every_kind_checked(pair):
    """Length evidence shorter than the replayed histories refuses every handoff under the run's own policy; the
    kinds planted in the map, the source and the guard run with the length guard off, so each is still refused for
    its own reason and verified."""
    mapper = with_evidence(pair, evidence([measured(0, 32, 4)], [32], 1.0, 300, UNSAVED))  # verified to 4 tokens
    assert bind(pair.source, pair.target, mapper, pair.tokenizer_hash).verified_length == 4
    run = run_of(pair)
    replays = [(run.encode(EXAMPLES[0].history), run.groups(EXAMPLES[0].item)[0][0])]
    checks = rollback(run, mapper, replays, 3, (pair.tokenizer_hash,))
    assert checks["rollback_verified"] == 1.0, {k: v for k, v in checks.items() if v != 1.0}


def test_rollback_replay_says_what_broke(pair, monkeypatch):
    """A fallback that is not plain prefill (a mark left in the target's cache) fails the replay, and the record
    says it was the cache, not the refusal nor the tokens."""
    import src.runtime.cover

    honest = src.runtime.cover.reprefill

    def marked(switch, record, status, reason):
        found = honest(switch, record, status, reason)
        if status == "fallback_reprefill":
            switch.readers[switch.receiver].cache.layers[0].keys[..., 0, 0] += 0.5
        return found

    monkeypatch.setattr(src.runtime.cover, "reprefill", marked)
    run = run_of(pair)
    replays = [(run.encode(ex.history), run.groups(ex.item)[0][0]) for ex in EXAMPLES[:1]]
    checks = rollback(run, pair.exact, replays, 3, (pair.tokenizer_hash,))
    assert checks["rollback_verified"] == 0.0 and checks["rollback.nonfinite_map"] == 0.0
    assert (
        checks["rollback.nonfinite_map.refused"] == 1.0 and checks["rollback.nonfinite_map.cache_max_abs_diff"] == 0.5
    )
    assert checks["rollback.artifact_mismatch"] == 1.0  # refused at binding: "unsupported", no fallback to mark


def test_cache_difference_names_nan_and_length_as_infinite():
    from transformers import DynamicCache

    from src.eval.rollback import cache_max_abs_diff

    def cache(values: torch.Tensor) -> DynamicCache:
        found = DynamicCache()
        found.update(torch.zeros_like(values), values, 0)
        return found

    zeros = cache(torch.zeros(1, 1, 3, 2))
    assert cache_max_abs_diff(zeros, cache(torch.full((1, 1, 3, 2), 0.25))) == 0.25
    assert cache_max_abs_diff(zeros, cache(torch.full((1, 1, 3, 2), float("nan")))) == float("inf")  # max() skips NaN
    assert cache_max_abs_diff(zeros, cache(torch.zeros(1, 1, 4, 2))) == float("inf")


def row(task, correct: bool, native: bool, history: int = 100, ttft=(10.0, 30.0, 2.0)) -> dict:
    pick = lambda ok: [[-1.0, 1.0], [-2.0, 0.0]] if ok else [[-2.0, 0.0], [-1.0, 1.0]]
    return {
        "task": task, "label": 0, "lengths": [1, 1], "history_tokens": history, "turn_tokens": 5,
        "scores": {"routed": pick(correct), "native_target": pick(native), "native_source": pick(False)},
        "nll": {"routed": 1.0, "native_target": 0.5, "native_source": 2.0},
        "ttft": dict(zip(("routed", "reprefill", "hit"), ttft, strict=True)),
        "handoff": {"prefill_fraction": 0.25},
    }  # fmt: skip


def test_metrics_from_rows():
    rows = [row("piqa", i % 4 != 0, True) for i in range(40)] + [row("mmlu", True, i % 2 == 0) for i in range(40)]
    metrics = quality(rows, 500, 0)
    assert metrics["task.piqa.loss_points"] == pytest.approx(25.0) and metrics["task.mmlu.loss_points"] == -50.0
    assert metrics["task.mean.loss_points"] == pytest.approx(-12.5)
    assert metrics["task.mean.loss_points_low"] < -12.5 < metrics["task.mean.loss_points_high"]
    assert metrics["task.piqa.nll_routed"] == 1.0 and metrics["task.piqa.prefill_fraction"] == 0.25
    # per-item native − routed: piqa 1 on a quarter of the items, mmlu −1 on half (what a paired CI scales with)
    assert metrics["task.piqa.loss_points_sd"] == pytest.approx(100 * np.std([1, 0, 0, 0] * 10, ddof=1))
    assert metrics["task.mmlu.loss_points_sd"] == pytest.approx(100 * np.std([0, -1] * 20, ddof=1))
    # the source (always wrong here) minus the routed session: escalation helped, so below zero
    assert metrics["task.piqa.below_source_points"] == pytest.approx(-75.0)
    assert metrics["task.mmlu.below_source_points"] == metrics["task.mmlu.below_source_points_high"] == -100.0
    assert metrics["task.mean.below_source_points"] == pytest.approx(-87.5)
    assert metrics["task.mean.below_source_points_low"] < -87.5 < metrics["task.mean.below_source_points_high"]
    rows[0]["ttft"] = {"routed": 10.0, "reprefill": 100.0, "hit": 1.0}
    rows[1]["history_tokens"] = 5000
    times = timing(rows, 500, 0)
    assert times["ttft_speedup"] == 3.0 and times["ttft.reprefill_ms_p50"] == 30.0
    assert (
        times["ttft_speedup_low"] == times["ttft_speedup_high"] == 3.0
    )  # 79 of 80 ratios are 3: every resample's median
    assert "ttft.routed.le_8192_ms_p50" in times and "ttft.hit.le_512_ms_p95" in times
    assert "ttft.same_work_ratio" not in times  # every handoff mapped, none sampled: no same-work pair
    rows[2] |= {"ttft": {"routed": 20.0, "reprefill": 30.0, "hit": 1.0}, "handoff": {"path": "reprefill"}}
    rows[3] |= {"ttft": {"routed": 40.0, "reprefill": 40.0, "hit": 1.0}, "handoff": {"path": "reprefill"}}
    rows[4] |= {"ttft": {"routed": 20.0, "reprefill": 50.0, "hit": 1.0}, "handoff": {"path": "reprefill"}}
    times = timing(rows, 500, 0)  # the routed session re-prefilled 3 turns: the baseline's work, 1.5× slower (median)
    assert times["ttft.same_work_ratio"] == 1.5 and times["ttft.same_work_items"] == 3.0
    rows[5]["ttft"] |= {"same_work": 15.0}  # a sampled item: the baseline's 30 ms re-prefill took 15 in the routed slot
    rows[6]["ttft"] |= {"same_work": 15.0}
    times = timing(rows, 500, 0)
    assert times["ttft.same_work_ratio"] == 2.0 and times["ttft.same_work_items"] == 5.0
    records = [
        {"sender": "source", "receiver": "target", "status": "applied", "path": "map", "context": 100, "hit": 0,
         "prefill_fraction": 0.0, "bytes": 10},
        {"sender": "source", "receiver": "target", "status": "fallback_reprefill", "path": "reprefill",
         "context": 3000, "hit": 0, "prefill_fraction": 1.0, "bytes": 0},
        {"sender": None, "receiver": "source", "status": "applied", "path": "hit", "context": 0, "hit": 0,
         "prefill_fraction": 0.0, "bytes": 0},
    ]  # fmt: skip
    counted = handoffs(records, 4)
    assert counted["handoff_frequency"] == 0.5 and counted["prefill_fraction"] == pytest.approx(3000 / 3100)
    assert counted["refusals.source_to_target.le_8192"] == 1.0 and "refusals.source_to_target.le_512" not in counted
    assert counted["handoffs.source_to_target.le_512"] == 1.0 and counted["handoffs.fallback_reprefill"] == 1.0
    assert [bucket(n) for n in (1, 512, 513, 40000)] == ["le_512", "le_512", "le_2048", "gt_32768"]


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    defaults = yaml.safe_load((REPO / "conf/run.yaml").read_text())["defaults"]
    listed = any(isinstance(entry, dict) and "workload" in entry for entry in defaults)
    workload = [o if listed else "+" + o for o in overrides if o.startswith("workload=")]
    rest = [o for o in overrides if not o.startswith("workload=")]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose("run", overrides=["+experiment=routed", *workload, *rest])


@pytest.mark.parametrize("items", ["test", "valid"])
def test_routed_job_end_to_end_on_the_tiny_random_pair(items, tmp_path, monkeypatch):
    if not (DATA / "eval").is_dir():
        pytest.skip("shared data not found")
    from src.gate_criteria import judge_run
    from src.gate_evidence import evidence
    from src.routed import routed

    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path / "home"))
    cfg = compose(
        "workload=passage", "workload.limit=2", "workload.tasks=[lambada]", "pair.attn_implementation=sdpa",
        "workload.rollback_items=1", "workload.rollback_tokens=2", "budget.sequences=8", "budget.seq_len=64",
        f"paths.data={DATA}", "tracking.backend=json", f"tracking.json_dir={tmp_path / 'records'}",
        f"workload.split={items}", "eval.diagnose.fidelity=true", "eval.diagnose.prompts_per_task=2",
        "eval.diagnose.read_error=true",
    )  # fmt: skip
    accuracy = routed(cfg)
    (path,) = (tmp_path / "records").glob("*/record.json")
    record = json.loads(path.read_text())
    metrics, tags = {m["key"]: m["value"] for m in record["metrics"] if m["step"] is None}, record["tags"]
    assert record["status"] == "FINISHED" and record["experiment"] == "routed"
    assert (tags["job"], tags["workload"], tags["weights"], tags["policy"]) == ("routed", "passage", "random", "map")
    assert tags["split"] == items and record["name"].endswith(":valid") == (items == "valid")
    scored = [row["index"] for row in json.loads((path.parent / "artifacts/routed/items.json").read_text())["items"]]
    assert scored == [item.index for item in load_task("lambada", DATA, 2, items)]
    assert metrics["task.mean.acc"] == accuracy and metrics["task.lambada.items"] == 2
    assert {"task.lambada.loss_points_low", "ttft_speedup", "prefill_fraction", "handoff_frequency"} <= set(metrics)
    assert metrics["ttft_speedup_low"] <= metrics["ttft_speedup"] <= metrics["ttft_speedup_high"]  # the gate's CI
    assert metrics["ttft.same_work_items"] == 1.0 and metrics["ttft.same_work_ratio"] > 0  # item 0 of 2, every 8th
    assert metrics["rollback_verified"] == 1.0 and metrics["handoffs.applied"] == 2
    assert -1 <= metrics["fidelity.attention_output_cosine"] <= 1 and "fidelity.prompt_r2_v" in metrics
    artifacts = path.parent / "artifacts"
    assert (artifacts / "plots/ttft_vs_prefix.png").is_file()
    assert (artifacts / "plots/accuracy_vs_prefill_fraction.png").is_file()
    rows = json.loads((artifacts / "routed/items.json").read_text())["items"]
    assert len(rows) == 2 and all(len(row["read_error"]["layers"]) == 6 for row in rows)  # the receiver's 6 layers
    assert metrics["read_error.mean"] == pytest.approx(np.mean([row["read_error"]["mean"] for row in rows]))
    assert 0 < metrics["read_error.mean_low"] <= metrics["read_error.mean"] <= metrics["read_error.mean_high"]
    assert {f"read_error.layer_{n}" for n in range(6)} | {"read_error.share_sink", "read_error.max"} <= set(metrics)
    document = json.loads((artifacts / "routed/items.json").read_text())
    judged = evidence(record["name"], "r", 0, metrics, record["params"], tags, document, str(artifacts))
    verdicts = {v.criterion.split(":")[0]: v.status for v in judge_run(judged)}
    assert verdicts["quality"] == "MISSING"  # random weights
    assert verdicts["record"] == "PASS"  # what the job logged is what its items give
    assert verdicts["routed workload run"] == ("PASS" if items == "test" else "FAIL")  # validation items never gate


class _Reached(Exception):
    pass


def test_the_policy_on_the_command_line_reaches_the_routed_session(tmp_path, monkeypatch):
    """`policy.*` (conf/policy/default.yaml: mode, levers, guards) is the policy the routed job's session runs; a
    policy that cannot hold is refused before any model loads."""
    if not (DATA / "eval").is_dir():
        pytest.skip("shared data not found")
    import src.pipeline
    import src.routed
    import src.routed_runs
    from src.runtime.plan import Levers

    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(src.pipeline, "_MEMO", {})  # this test's pair and traces stay out of the process's memo
    with monkeypatch.context() as patch, pytest.raises(ValueError, match="recompute_rule must be one of"):
        patch.setattr(src.routed, "load", lambda cfg: pytest.fail("the bad policy was not refused first"))
        src.routed.routed(compose("workload=passage", "policy.levers.recompute_rule=fastest", f"paths.data={DATA}"))
    built, real = [], src.routed_runs.Session

    def session(models, routes, policy, *args, **kwargs):
        if policy.mode == "reprefill":  # the all-re-prefill session: the workload's policy is not its own
            return real(models, routes, policy, *args, **kwargs)
        built.append(policy)
        raise _Reached

    monkeypatch.setattr(src.routed_runs, "Session", session)
    cfg = compose(
        "workload=passage", "workload.limit=1", "workload.tasks=[lambada]", "budget.sequences=8", "budget.seq_len=64",
        f"paths.data={DATA}", "tracking.backend=json", f"tracking.json_dir={tmp_path / 'records'}",
        "policy.mode=auto", "policy.levers.recompute=0.25", "policy.levers.native_sink=2", "policy.max_length_factor=4",
    )  # fmt: skip
    with pytest.raises(_Reached):
        src.routed.routed(cfg)
    assert built == [Policy("auto", Levers(native_sink=2, recompute=0.25), 4.0)]


def test_routed_job_on_the_static_engine_scores_what_the_hf_sessions_score(tmp_path, monkeypatch):
    """workload.engine_capacity: every session (routed, all-re-prefill, same-work twin, rollback replay) holds its
    models on engines kept across items; on CPU (fp32) the items score as on HF DynamicCache sessions, rollback holds,
    the harness is sampled, the run is tagged with its engine; a workload the engine does not run yet is refused."""
    if not (DATA / "eval").is_dir():
        pytest.skip("shared data not found")
    import src.pipeline
    from src.routed import routed

    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(src.pipeline, "_MEMO", {})  # this test's pair and traces stay out of the process's memo
    with pytest.raises(ValueError, match="does not run on the engine"):  # refused before any model is loaded
        routed(compose("workload=multiturn", "workload.engine_capacity=2048", f"paths.data={DATA}"))
    with pytest.raises(ValueError, match="no shared history to compare"):  # refused before any model is loaded
        routed(compose("workload=multiturn", "eval.diagnose.read_error=true", f"paths.data={DATA}"))
    common = (
        "workload=passage", "workload.limit=2", "workload.tasks=[lambada]", "workload.rollback_items=1",
        "workload.rollback_tokens=2",
        "budget.sequences=8", "budget.seq_len=64", f"paths.data={DATA}", "tracking.backend=json",
        "eval.diagnose.read_error=true",
    )  # fmt: skip
    results = {}
    for engine in ("null", "2048"):
        records = tmp_path / f"records-{engine}"
        routed(compose(*common, f"workload.engine_capacity={engine}", f"tracking.json_dir={records}"))
        (path,) = records.glob("*/record.json")
        record = json.loads(path.read_text())
        assert record["status"] == "FINISHED"
        results[engine] = record["tags"], {m["key"]: m["value"] for m in record["metrics"] if m["step"] is None}
    (hf_tags, hf), (engine_tags, on_engine) = results["null"], results["2048"]
    assert (hf_tags["engine"], engine_tags["engine"]) == ("hf", "static")
    for key in ("task.mean.acc", "task.mean.loss_points", "handoffs.applied", "prefill_fraction"):
        assert on_engine[key] == pytest.approx(hf[key], abs=1e-9), key
    assert on_engine["read_error.mean"] == pytest.approx(hf["read_error.mean"], rel=1e-4)  # slots read as the cache
    assert hf["read_error.mean"] > 0
    assert on_engine["rollback_verified"] == 1.0 and on_engine["ttft.same_work_items"] == 1.0


def test_a_jobs_engines_are_freed_when_it_returns(tmp_path, monkeypatch):
    """`src.run.main` collects after each job: a routed job's engines sit in reference cycles, and a sweep's next job
    on a GPU found the earlier jobs' CUDA graph pools still held (20 GB in one process, 2026-12-07). Every engine the
    job made is gone the moment it returns, before any collection the test could trigger."""
    if not (DATA / "eval").is_dir():
        pytest.skip("shared data not found")
    import src.pipeline
    import src.run
    from src.runtime import engine

    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(src.pipeline, "_MEMO", {})
    made, build = [], engine.Engine.__init__

    def tracked(self, *args, **kwargs):
        build(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(engine.Engine, "__init__", tracked)
    cfg = compose(
        "workload=passage", "workload.limit=1", "workload.tasks=[lambada]", "workload.rollback_items=1",
        "workload.rollback_tokens=2", "workload.engine_capacity=2048", "budget.sequences=8", "budget.seq_len=64",
        f"paths.data={DATA}", "tracking.backend=json", f"tracking.json_dir={tmp_path / 'records'}",
    )  # fmt: skip
    gc.disable()  # only the job's own collection may free them
    try:
        src.run.main.__wrapped__(cfg)
        assert made and not [ref for ref in made if ref() is not None]
    finally:
        gc.enable()


def test_a_failing_job_outside_a_sweep_keeps_its_own_error(monkeypatch):
    """Called without Hydra's launcher (a composed config, as tests and notebooks do), a failing job raises its own
    error: the sweep's failure report asks Hydra's run mode only where Hydra set one."""
    import src.run

    def failing(cfg):
        raise RuntimeError("the job's own error")

    monkeypatch.setitem(src.run.JOBS, "routed", failing)
    with pytest.raises(RuntimeError, match="the job's own error"):
        src.run.main.__wrapped__(compose("workload=passage", f"paths.data={DATA}"))


def _scored(task: str, index: int, right: bool) -> dict:
    """An item whose routed session answers right or not (label 0, two choices)."""
    choices = [[-0.1, 1.0], [-2.0, 0.0]] if right else [[-2.0, 0.0], [-0.1, 1.0]]
    return {"task": task, "index": index, "label": 0, "lengths": [2, 3], "history_tokens": 8, "turn_tokens": 2} | {
        "scores": {"routed": choices},
        "handoff": {"prefill_fraction": 0.5},
    }


def test_paired_gain_compares_two_runs_on_their_shared_items():
    """A − B on the items both scored (B's extra item is ignored), mean over tasks; no shared item is an error."""
    first = [_scored("boolq", 0, True), _scored("boolq", 32, True), _scored("piqa", 0, False)]
    second = [
        _scored("boolq", 0, False),
        _scored("boolq", 32, True),
        _scored("piqa", 0, False),
        _scored("piqa", 9, True),
    ]
    found = paired_gain(first, second, n_boot=200, seed=0)
    assert found.estimate == pytest.approx(0.25)  # boolq +0.5, piqa 0 (its item 9 is B's alone)
    assert paired_gain(second, first, 200, 0).estimate == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="share no scored item"):
        paired_gain(first, [_scored("boolq", 1, True)], 200, 0)


# --- the clock: what each TTFT contains -----------------------------------------------------------------------------


class _Slow:
    """A transfer that takes at least `seconds` per call (the mapper's own work, made visible to the clock)."""

    def __init__(self, transfer, seconds: float):
        self.transfer, self.seconds = transfer, seconds

    def __call__(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.transfer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.transfer, name)


def slow_run(pair, seconds: float) -> Run:
    run = run_of(pair)
    routes = {key: replace(route, transfer=_Slow(route.transfer, seconds)) for key, route in run.routes.items()}
    return replace(run, routes=routes)


@pytest.mark.parametrize("runner", ["single_turn", "switches"])
def test_the_routed_ttft_contains_the_map(pair, runner):
    """A map that takes 40 ms must be inside the routed TTFT of every mapped handoff, and the TTFT cannot be shorter
    than the map's own recorded ms: a clock started after the switch, or a map moved out of the timed region, fails."""
    delay = 0.04
    run = slow_run(pair, delay)
    rows = single_turn(run, EXAMPLES)[0] if runner == "single_turn" else switches(run, EXAMPLES[:2], [1, 2])[0]
    assert rows and all(row["handoff"]["path"] == "map" for row in rows)
    for row in rows:
        assert row["handoff"]["ms_map"] >= 1e3 * delay  # the spy's delay is the map's
        assert row["ttft"]["routed"] >= row["handoff"]["ms_map"] >= 1e3 * delay
        assert row["ttft"]["routed"] >= row["handoff"]["ms"]


def test_every_timed_path_runs_under_inference_mode_without_cudnn_attention(pair, monkeypatch):
    """Every switch the runners time (routed, re-prefill baseline, same work) and the prefix hit run under
    torch.inference_mode with cuDNN's SDPA off (it builds a graph per new sequence length inside the clock: ≈ 40 ms per
    re-prefill on an H100, results/gate-h100-2026-12-06), the untimed steps on torch's own choice, and no forward of
    either model runs with autograd on."""
    from src.runtime.session import Session

    switched, forwards = [], []
    honest = Session.switch_to

    def spy(self, model, turn=()):
        switched.append(torch.is_inference_mode_enabled() and not torch.backends.cuda.cudnn_sdp_enabled())
        forwards.append("switch")
        try:
            return honest(self, model, turn)
        finally:
            forwards.append("end")

    def hook(module, args):
        forwards.append(
            (torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
        )

    monkeypatch.setattr(Session, "switch_to", spy)
    handles = [model.register_forward_pre_hook(hook) for model in (pair.source, pair.target)]
    try:
        single_turn(run_of(pair), EXAMPLES)
    finally:
        for handle in handles:
            handle.remove()
    assert switched and all(switched)  # 4 items × (baseline + routed) + 2 sampled same-work switches
    assert len(switched) == 4 * 2 + 2
    assert not any(entry[1] for entry in forwards if isinstance(entry, tuple))  # autograd never on
    timed = [entry for entry in forwards if isinstance(entry, tuple) and entry[0]]  # the switches' and hits' forwards
    assert timed and not any(entry[2] for entry in timed)
    assert all(entry[2] for entry in forwards if isinstance(entry, tuple) and not entry[0])  # given back after each
    depth, hits = 0, 0
    for entry in forwards:  # forwards in inference mode outside every switch: the prefix hits, one per item
        depth += entry == "switch"
        depth -= entry == "end"
        hits += isinstance(entry, tuple) and depth == 0 and entry[0]
    assert hits == 4


def _spied(monkeypatch) -> list[tuple[str, dict]]:
    """Every timed switch: (the session's policy mode, its handoff record)."""
    import src.routed_runs as runners

    calls, honest = [], runners.first_token

    def spy(session, receiver, turn):
        found = honest(session, receiver, turn)
        calls.append((session.policy.mode, asdict(found[0])))
        return found

    monkeypatch.setattr(runners, "first_token", spy)
    return calls


def test_the_switches_baseline_reads_only_what_its_receiver_has_not_seen(pair, monkeypatch):
    """After s switches the target holds the chunks before the last (read natively or mapped): the routed handoff
    maps the last chunk only, so the re-prefill baseline goes through the same switches and re-prefills exactly
    those tokens (and the same work sampled in the routed session does too)."""
    calls = _spied(monkeypatch)
    switches(run_of(pair, every=1), EXAMPLES[1:2], [1, 2, 4])
    history = Run.encode(run_of(pair), EXAMPLES[1].history).numel()
    timed = [(mode, r) for mode, r in calls if r["receiver"] == "target" and r["context"] == history]
    per_count = [timed[i : i + 3] for i in range(len(timed) - 9, len(timed), 3)]  # the scored item: 3 counts
    for count, (baseline, same, routed) in zip([1, 2, 4], per_count, strict=True):
        assert (baseline[0], same[0], routed[0]) == ("reprefill", "reprefill", "map")
        unseen = routed[1]["context"] - routed[1]["hit"]
        assert routed[1]["mapped"] == unseen and (count == 1) == (unseen == history)
        for other in (baseline[1], same[1]):
            assert (other["hit"], other["prefilled"], other["path"]) == (routed[1]["hit"], unseen, "reprefill")


def test_the_same_work_is_the_baseline_s_work_in_the_routed_slot(pair, monkeypatch):
    """Every k-th scored item re-prefills its handoff in a copy of the routed session: the baseline's tokens, on the
    routed session's clock; the routed session's records and the `auto` policy's costs are untouched by it."""
    calls = _spied(monkeypatch)
    run = run_of(pair, every=1)
    rows, records = single_turn(run, EXAMPLES)
    assert all("same_work" in row["ttft"] for row in rows) and len(records) == 3
    modes = [mode for mode, _ in calls]
    assert modes == ["reprefill", "map"] + ["reprefill", "reprefill", "map"] * 3  # warm-up: not sampled
    for baseline, same in ((calls[i][1], calls[i + 1][1]) for i in range(2, len(calls), 3)):
        assert {k: baseline[k] for k in ("hit", "prefilled", "turn")} == {
            k: same[k] for k in ("hit", "prefilled", "turn")
        }
    observed = []
    for every in (1, 1000):
        costed = run_of(pair, every=every)
        single_turn(costed, EXAMPLES)
        observed.append({key: len(samples) for key, samples in costed.costs.samples.items()})
    assert observed[0] == observed[1]


@pytest.mark.parametrize("every", [0, -1, 2.0, True, None])
def test_a_same_work_rate_that_samples_nothing_is_a_clear_error(pair, every):
    with pytest.raises(ValueError, match="workload.same_work_every must be an integer ≥ 1"):
        run_of(pair, every=every)


def test_multiturn_samples_the_handoffs_of_every_kth_conversation(pair):
    if not (DATA / "eval").is_dir():
        pytest.skip("shared data not found")
    escalation = OmegaConf.create({"policy": "schedule", "every": 2, "threshold": 0.0})
    rows, _, _, _ = multiturn(run_of(pair, every=2), DATA, ["arc_easy"], 6, 2, escalation)
    sampled = [row["conversation"] for row in rows if "same_work" in row["ttft"]]
    assert sampled == ["arc_easy#0", "arc_easy#2"]  # conversations 0 and 2 of 3, their one handoff each
    assert all({"routed", "same_work"} <= set(row["ttft"]) for row in rows if "same_work" in row["ttft"])


# --- the speedup's CI ---------------------------------------------------------------------------------------------


def test_median_ci_is_seeded_and_narrows_with_more_handoffs():
    rng = np.random.default_rng(0)
    few, many = rng.lognormal(0.7, 0.3, 20), rng.lognormal(0.7, 0.3, 2000)
    first, again = median_ci(list(few), 1000, 3), median_ci(list(few), 1000, 3)
    assert first == again and first.low <= first.estimate == np.median(few) <= first.high
    wide, narrow = first.high - first.low, median_ci(list(many), 1000, 3)
    assert narrow.high - narrow.low < wide / 4  # ≈ 1/√100 of the width: the resampling is over handoffs
    assert narrow.low <= np.exp(0.7) <= narrow.high  # the lognormal's median


@pytest.mark.parametrize(
    ("values", "n_boot", "message"),
    [([], 10, "needs values"), ([1.0, float("nan")], 10, "finite values: 1 of 2"), ([1.0], 0, "n_boot ≥ 1")],
)
def test_median_ci_refuses_what_it_cannot_summarize(values, n_boot, message):
    with pytest.raises(ValueError, match=message):
        median_ci(values, n_boot, 0)


def test_a_zero_or_nan_ttft_gives_a_nan_speedup_not_a_number():
    """The gate reads NaN as MISSING; an infinite or NaN ratio must not become a median or a bound."""
    handoffs_ = [{"ttft": {"routed": 10.0, "reprefill": 30.0}}, {"ttft": {"routed": 0.0, "reprefill": 30.0}}]
    assert all(math.isnan(v) for v in speedup_ci(handoffs_, 100, 0).values())
    assert speedup_ci([{"ttft": {"hit": 1.0}}], 100, 0) == {}
