"""Length evidence (src/length_evidence.py, src/artifact.py `verified_length` / `length_evidence`) and the session's
length guard that reads it (src/runtime/routing.py `Policy.length_guard`): routed validation records binned by
history length into the mapper's manifest — test, random-weight and other-mapper runs refused — published atomically
and verified by the version id (tampered, inconsistent or unversioned evidence is refused, never used); the session
maps a history of the verified length and refuses one token more (the factor rule without evidence), and a refusal
replays bit-identically to plain prefill (tests/test_session.py REFUSALS)."""

import hashlib
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import src.pipeline
import src.routed
from src.artifact import EVIDENCE, ArtifactError, EvidenceDroppedWarning, load_mapper, save_mapper, verified_length
from src.artifact_store import MANIFEST_FILE, POINTER, TENSOR_FILE, publish
from src.length_evidence import add_evidence, bins, evidence, main, table
from src.records import ITEMS, RecordError, pack
from src.runtime.routing import Policy, bind
from src.runtime.session import Session
from tests.exact_pair import exact_pair

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared/data"
EDGES = [16, 32, 64]
UNSAVED = None  # the tensor_sha256 of the exact pair's mapper, never saved: its evidence binds to no coefficients


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on a shared 2-core machine (conftest.one_thread)."""


@pytest.fixture(scope="module")
def pair():
    return exact_pair("llama", seed=0)


@pytest.fixture
def mapper_dir(pair, tmp_path):
    return save_mapper(replace(pair.exact, manifest=dict(pair.exact.manifest)), tmp_path / "mapper")


def item(index: int, history: int, routed_correct: bool = True, mapped: bool = True, task: str = "boolq") -> dict:
    """One routed item row (src/routed_runs.py `item_row`): the native target always right, the routed one as asked."""
    right, wrong = [[-0.1, 1.0], [-2.0, 0.0]], [[-2.0, 0.0], [-0.1, 1.0]]
    handoff = {"path": "map", "status": "applied"} if mapped else {"path": "reprefill", "status": "fallback_reprefill"}
    return {
        "task": task, "index": index, "label": 0, "lengths": [3, 3], "history_tokens": history, "turn_tokens": 4,
        "scores": {"native_target": right, "native_source": wrong, "routed": right if routed_correct else wrong},
        "handoff": handoff | {"prefill_fraction": 0.0},
    }  # fmt: skip


def record(folder: Path, manifest: dict, items: list[dict], **tags) -> Path:
    """A FINISHED routed record on validation items of this mapper (tags overridable), with its items artifact."""
    (folder / "artifacts/routed").mkdir(parents=True)
    own = {
        "job": "routed", "workload": "fewshot_long", "split": "valid", "weights": "real", "policy": "map",
        "source_fingerprint": manifest["source_fingerprint"], "target_fingerprint": manifest["target_fingerprint"],
        "tokenizer_hash": manifest["tokenizer_hash"], "mapper_tensor_sha256": manifest["tensor_sha256"],
    }  # fmt: skip
    params = {"eval.tasks.n_boot": "1000", "seed": "0", "pair.dtype": "float32", "policy.levers.native_sink": "4"}
    body = {"name": f"run:{folder.name}", "status": "FINISHED", "params": params, "tags": own | tags, "metrics": []}
    (folder / "record.json").write_text(json.dumps(body))
    (folder / "artifacts/routed/items.json").write_text(json.dumps({"items": items}))
    return folder


def measured(low: int, high: int | None, length: int, items: int = 300, high_ci: float | None = 0.5) -> dict:
    """A measurement row as src/length_evidence.py writes it (what the rule reads)."""
    return {
        "bin": [low, high], "length": length, "items": items, "refused": 0, "loss_points": 0.0,
        "loss_points_low": 0.0, "loss_points_high": high_ci, "split": "valid", "run_id": f"run-{high}",
        "record": f"results/x/run-{high}/record.json",
    }  # fmt: skip


# ---------------------------------------------------------------- the rule


def test_the_verified_length_is_the_longest_history_of_the_last_bin_that_passes_from_the_shortest_up():
    rows = [measured(0, 16, 15), measured(16, 32, 30), measured(32, 64, 50, high_ci=1.5), measured(64, None, 90)]
    assert verified_length(rows, 1.0, 300) == (30, rows[1])  # 32–64 fails: 64+ does not count, though it passes
    assert verified_length(rows, 2.0, 300) == (90, rows[3])  # past the last edge: the open bin's longest history
    assert verified_length(rows[:1] + rows[2:3], 2.0, 300) == (15, rows[0])  # a gap (16–32 unmeasured) stops it
    assert verified_length([measured(0, 16, 15, items=299)] + rows[1:], 1.0, 300) == (0, None)  # too few items
    assert verified_length([measured(0, 16, 15, items=0, high_ci=None)], 1.0, 300) == (0, None)  # all refused
    assert verified_length(rows[1:2], 1.0, 300) == (30, rows[1])  # histories shorter than the shortest bin measured
    both = [measured(0, 16, 15), {**measured(0, 16, 12), "loss_points_high": 3.0}]
    assert verified_length(both, 1.0, 300) == (0, None)  # a bin passes only when every run measuring it does
    assert bins([16, 32]) == [(0, 16), (16, 32), (32, None)]
    for bad in ([], [0, 8], [16, 16], [32, 16], [8.0]):
        with pytest.raises(ValueError, match="length edges must"):
            bins(bad)


# ---------------------------------------------------------------- records → manifest


def test_validation_records_become_verified_evidence_in_a_new_version(mapper_dir, tmp_path, capsys):
    manifest = load_mapper(mapper_dir).manifest
    old_version, tensors = (mapper_dir / POINTER).resolve(), (mapper_dir / TENSOR_FILE).read_bytes()
    items = [item(n, 10 + n % 6) for n in range(300)]  # (0, 16]: 300 mapped, none differs: CI [0, 0]
    items += [item(300 + n, 20 + n % 12, routed_correct=n % 10 != 0) for n in range(300)]  # (16, 32]: 10 points lost
    items += [item(600 + n, 40, mapped=False) for n in range(5)]  # (32, 64]: refused, re-prefilled: not measured
    run = record(tmp_path / "runs/long-1", manifest, items)
    block = add_evidence(mapper_dir, [run / "record.json"], EDGES, 1.0, 300)
    assert block["max_verified_length"] == 15 and block["verified_by"] == f"long-1 ({run / 'record.json'})"
    rows = {tuple(row["bin"]): row for row in block["measurements"]}
    assert sorted(rows) == [(0, 16), (16, 32), (32, 64)]
    assert (rows[(0, 16)]["items"], rows[(0, 16)]["loss_points_high"]) == (300, 0.0)
    assert rows[(16, 32)]["loss_points"] == pytest.approx(10.0) and rows[(16, 32)]["loss_points_low"] > 1.0
    assert (rows[(32, 64)]["items"], rows[(32, 64)]["refused"], rows[(32, 64)]["loss_points"]) == (0, 5, None)
    assert rows[(0, 16)]["levers"] == {"native_sink": "4"} and rows[(0, 16)]["run"] == "run:long-1"
    loaded = load_mapper(mapper_dir)  # verified: the version id is the sha256 of the manifest with the evidence
    new_version = (mapper_dir / POINTER).resolve()
    assert loaded.manifest[EVIDENCE] == block and new_version != old_version and not old_version.exists()
    assert new_version.name == hashlib.sha256((new_version / "mapper.json").read_bytes()).hexdigest()
    assert (mapper_dir / TENSOR_FILE).read_bytes() == tensors  # the coefficients are the very bytes they were
    assert "| (16, 32] | 31 | 300 | 0 | 10.00 [" in table(block) and "max_verified_length: 15 tokens" in table(block)
    main_argv = ["src.length_evidence", str(mapper_dir), str(run), "--edges", "16,32,64"]
    assert pack([run]) == [run / f"{ITEMS}.gz"]  # its items stored packed, as committed records keep them
    with pytest.MonkeyPatch.context() as patch:  # the command: the same evidence again, its table printed
        patch.setattr("sys.argv", main_argv + ["--min-items", "300"])
        main()
    assert "max_verified_length: 15 tokens (long-1 (" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("tags", "message"),
    [
        ({"split": "test"}, "test items never choose a threshold"),
        ({"split": None}, "a run on unnamed items"),
        ({"weights": "random"}, "random weights make no quality claim"),
        ({"mapper_tensor_sha256": "0" * 64}, "ran another mapper than this one: mapper_tensor_sha256 000000000000"),
        ({"mapper_tensor_sha256": None}, "routed runs record it since the length evidence came in"),
        ({"target_fingerprint": "f" * 64}, "target_fingerprint ffffffffffff"),
        ({"workload": "switches"}, "hands off more than once per item"),
        ({"job": "fit_eval"}, "not a routed workload run"),
    ],
)
def test_records_that_cannot_show_evidence_are_refused_and_nothing_is_written(mapper_dir, tmp_path, tags, message):
    manifest = load_mapper(mapper_dir).manifest
    version = (mapper_dir / POINTER).resolve()
    good = record(tmp_path / "runs/good", manifest, [item(n, 10) for n in range(3)])
    bad = record(tmp_path / "runs/bad", manifest, [item(n, 10) for n in range(3)], **tags)
    if None in tags.values():
        body = json.loads((bad / "record.json").read_text())
        body["tags"] = {k: v for k, v in body["tags"].items() if v is not None}
        (bad / "record.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match=message):
        add_evidence(mapper_dir, [good, bad], EDGES, 1.0, 300)
    assert (mapper_dir / POINTER).resolve() == version and EVIDENCE not in load_mapper(mapper_dir).manifest


def test_a_record_given_twice_or_unfinished_and_bad_settings_are_refused(mapper_dir, tmp_path, capsys):
    manifest = load_mapper(mapper_dir).manifest
    run = record(tmp_path / "runs/one", manifest, [item(n, 10) for n in range(3)])
    with pytest.raises(ValueError, match="a record was given twice"):
        add_evidence(mapper_dir, [run, run / "record.json"], EDGES, 1.0, 300)
    for margin, min_items, message in ((float("nan"), 300, "margin"), (1.0, 0, "min_items")):
        with pytest.raises(ValueError, match=message):
            add_evidence(mapper_dir, [run], EDGES, margin, min_items)
    body = json.loads((run / "record.json").read_text()) | {"status": "FAILED"}
    (run / "record.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match="status 'FAILED', not FINISHED"):
        add_evidence(mapper_dir, [run], EDGES, 1.0, 300)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exited:
        patch.setattr("sys.argv", ["src.length_evidence", str(mapper_dir), str(run), "--edges", "16,x"])
        main()
    assert "--edges takes comma-separated token counts" in str(exited.value)


def test_an_item_listed_twice_is_refused_not_counted_twice_toward_min_items(mapper_dir, tmp_path):
    """Issue 32 item 5: 150 items each listed twice would make 300 rows and pass min_items = 300 on half the items.
    Refused (not deduplicated: the routed job writes each item once, and no rule says which copy counts)."""
    manifest = load_mapper(mapper_dir).manifest
    version = (mapper_dir / POINTER).resolve()
    once = [item(n, 10) for n in range(150)]
    run = record(tmp_path / "runs/twice", manifest, once + once)
    with pytest.raises(RecordError, match=r"items\[150\]: item \('boolq', 0\) is listed twice \(first at items\[0\]\)"):
        add_evidence(mapper_dir, [run], EDGES, 1.0, 300)
    assert (mapper_dir / POINTER).resolve() == version and EVIDENCE not in load_mapper(mapper_dir).manifest
    other_task = record(tmp_path / "runs/two-tasks", manifest, once + [item(n, 10, task="piqa") for n in range(150)])
    assert add_evidence(mapper_dir, [other_task], EDGES, 1.0, 300)["max_verified_length"] == 10  # same index, two tasks


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"history_tokens": "12"}, "history_tokens '12' is not a whole number ≥ 0"),
        ({"history_tokens": None}, "history_tokens None is not a whole number ≥ 0"),
        ({"history_tokens": 12.5}, "history_tokens 12.5 is not a whole number ≥ 0"),
        ({"turn_tokens": -1}, "turn_tokens -1 is not a whole number ≥ 0"),
        ({"index": True}, "index True is not a whole number ≥ 0"),
        ({"lengths": ["3", "3"]}, "lengths \\['3', '3'\\] or the scores"),
        (
            {"scores": {"native_target": [["a", 1], [0, 0]], "routed": [[0, 1], [0, 0]]}},
            r"lengths \[3, 3\] or the scores",
        ),
        ({"scores": {"routed": [[0, 1], [0, 0]]}}, r"lengths \[3, 3\] or the scores of native_target / routed"),
        ({"handoff": None}, "handoff None is not a handoff record"),
        ({"task": "nope"}, "task 'nope' is not one of the tasks"),
        ({"task": None}, "task None is not one of the tasks"),
        ("scores", "no 'scores'"),
    ],
)
def test_a_row_with_a_missing_or_non_numeric_field_gets_a_clear_error(mapper_dir, tmp_path, change, message):
    """Issue 32 item 5: a row the measurement cannot read is a RecordError naming the file, the row and the value,
    before anything is written — never a TypeError from inside the binning or the scores; the command prints it."""
    manifest = load_mapper(mapper_dir).manifest
    rows = [item(n, 10) for n in range(3)]
    rows[1] = {k: v for k, v in rows[1].items() if k != change} if isinstance(change, str) else rows[1] | change
    run = record(tmp_path / "runs/bad", manifest, rows)
    with pytest.raises(RecordError, match=r"items\.json items\[1\]: " + message):
        add_evidence(mapper_dir, [run], EDGES, 1.0, 300)
    assert EVIDENCE not in load_mapper(mapper_dir).manifest
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exited:
        patch.setattr("sys.argv", ["src.length_evidence", str(mapper_dir), str(run)])
        main()
    assert str(exited.value).startswith("length_evidence: ") and "items[1]" in str(exited.value)


# ---------------------------------------------------------------- tampering


def _with_evidence(mapper_dir: Path, tmp_path: Path) -> dict:
    manifest = load_mapper(mapper_dir).manifest
    run = record(tmp_path / "runs/r", manifest, [item(n, 10) for n in range(300)])
    add_evidence(mapper_dir, [run], EDGES, 1.0, 300)
    return json.loads((mapper_dir / MANIFEST_FILE).read_text())


def test_tampered_evidence_fails_verification(mapper_dir, tmp_path):
    manifest = _with_evidence(mapper_dir, tmp_path)
    assert manifest[EVIDENCE]["max_verified_length"] == 10
    forged = json.loads(json.dumps(manifest))
    forged[EVIDENCE]["max_verified_length"] = 32768  # a longer reach than was measured
    path = (mapper_dir / POINTER).resolve() / "mapper.json"
    path.write_text(json.dumps(forged))  # edited in place: the version id no longer matches
    with pytest.raises(ArtifactError, match="the manifest was changed after it was saved"):
        load_mapper(mapper_dir)
    tensors = (mapper_dir / TENSOR_FILE).read_bytes()
    publish(mapper_dir, json.dumps(forged).encode(), tensors)  # a consistent version of forged evidence
    with pytest.raises(ArtifactError, match="length evidence does not hold: it says max_verified_length 32768"):
        load_mapper(mapper_dir)
    forged[EVIDENCE]["max_verified_length"] = 10
    forged[EVIDENCE]["measurements"][0]["split"] = "test"  # measured on test items
    publish(mapper_dir, json.dumps(forged).encode(), tensors)
    with pytest.raises(ArtifactError, match="read 'test' items: a length threshold is chosen on validation items"):
        load_mapper(mapper_dir)
    forged[EVIDENCE]["measurements"][0] |= {"split": "valid", "items": "300"}
    publish(mapper_dir, json.dumps(forged).encode(), tensors)
    with pytest.raises(ArtifactError, match="length evidence is malformed: '>=' not supported"):
        load_mapper(mapper_dir)
    del forged[EVIDENCE]["measurements"][0]["length"]
    publish(mapper_dir, json.dumps(forged).encode(), tensors)
    with pytest.raises(ArtifactError, match=r"length evidence measurement 0 lacks \['length'\]"):
        load_mapper(mapper_dir)


def test_evidence_no_version_id_verifies_is_refused_and_a_copy_that_kept_it_loads(mapper_dir, tmp_path):
    manifest = _with_evidence(mapper_dir, tmp_path)
    flat = tmp_path / "flat"
    flat.mkdir()
    for name in (MANIFEST_FILE, TENSOR_FILE):
        shutil.copyfile(mapper_dir / name, flat / name)  # the older flat layout: nothing carries the id
    with pytest.raises(ArtifactError, match="carries length evidence but no version id verifies its bytes"):
        load_mapper(flat)
    copied = shutil.copytree(mapper_dir, tmp_path / "copy")  # links followed; versions/<id> kept
    assert load_mapper(copied).manifest[EVIDENCE] == manifest[EVIDENCE]


def test_a_mapper_saved_with_other_coefficients_loses_its_evidence(mapper_dir, tmp_path):
    """Issue 32 item 5: the evidence names the coefficients it was measured on (tensor_sha256). Saved again at
    another dtype, the mapper's evidence is dropped with a warning (the length guard falls back to the factor rule);
    saved with the very same bytes it is kept; a manifest whose evidence names other coefficients — what a save kept
    before this check — is refused at load, as is evidence that names none."""
    manifest = _with_evidence(mapper_dir, tmp_path)
    assert manifest[EVIDENCE]["tensor_sha256"] == manifest["tensor_sha256"]
    mapper = load_mapper(mapper_dir)
    save_mapper(mapper, tmp_path / "same", "float32")  # the very bytes: the evidence holds
    assert load_mapper(tmp_path / "same").manifest[EVIDENCE] == manifest[EVIDENCE]
    with pytest.warns(EvidenceDroppedWarning, match="measured on other coefficients than these \\(bfloat16"):
        save_mapper(load_mapper(mapper_dir), tmp_path / "bf16", "bfloat16")
    resaved = load_mapper(tmp_path / "bf16")
    assert EVIDENCE not in resaved.manifest and resaved.manifest["tensor_sha256"] != manifest["tensor_sha256"]
    tensors = (tmp_path / "bf16" / TENSOR_FILE).read_bytes()
    kept = resaved.manifest | {EVIDENCE: manifest[EVIDENCE]}  # the other coefficients' evidence, kept
    publish(tmp_path / "bf16", json.dumps(kept).encode(), tensors)
    with pytest.raises(ArtifactError, match="length evidence was measured on other coefficients: sha256 "):
        load_mapper(tmp_path / "bf16")
    unbound = resaved.manifest | {EVIDENCE: {k: v for k, v in manifest[EVIDENCE].items() if k != "tensor_sha256"}}
    publish(tmp_path / "bf16", json.dumps(unbound).encode(), tensors)  # evidence from before it named them
    with pytest.raises(ArtifactError, match=r"length evidence block lacks \['tensor_sha256'\]"):
        load_mapper(tmp_path / "bf16")


def test_a_bound_mapper_whose_evidence_does_not_hold_is_refused(pair):
    block = evidence([measured(0, 32, 20)], [32], 1.0, 300, UNSAVED) | {"max_verified_length": 4096}
    route = bind(pair.source, pair.target, with_evidence(pair, block), pair.tokenizer_hash)
    assert route.transfer is None and "length evidence does not hold" in route.refusal


# ---------------------------------------------------------------- the session's length guard


def with_evidence(pair, block: dict, calibrated: int | None = None):
    """The exact mapper with this evidence (and calibration length) in its manifest."""
    extra = {EVIDENCE: block} | ({"calibration": {"seq_len": calibrated}} if calibrated else {})
    return replace(pair.exact, manifest=pair.exact.manifest | extra)


def switch(pair, mapper, history: int, **policy):
    route = {("a", "b"): bind(pair.source, pair.target, mapper, pair.tokenizer_hash)}
    s = Session({"a": pair.source, "b": pair.target}, route, Policy(**policy))
    s.append("a", torch.arange(history) % 90)
    return s.switch_to("b", torch.tensor([5, 6, 7]))


def test_the_session_maps_at_the_verified_length_and_refuses_one_token_more(pair):
    block = evidence([measured(0, 32, 20)], [32], 1.0, 300, UNSAVED)  # verified: 20 tokens, shown by run-32
    mapper = with_evidence(pair, block)
    assert bind(pair.source, pair.target, mapper, pair.tokenizer_hash).verified_length == 20
    at, beyond = switch(pair, mapper, 20), switch(pair, mapper, 21)
    assert (at.path, at.status, at.mapped) == ("map", "applied", 20)
    assert (beyond.path, beyond.status, beyond.mapped) == ("reprefill", "fallback_reprefill", 0)
    assert beyond.reason == (
        "a history of 21 tokens is beyond the mapper's verified length 20 "
        "(shown by run-32 (results/x/run-32/record.json))"
    )
    assert switch(pair, mapper, 21, length_guard="off").path == "map"  # a measurement run maps every length
    nothing = with_evidence(pair, evidence([measured(0, 32, 20, high_ci=5.0)], [32], 1.0, 300, UNSAVED))
    refused = switch(pair, nothing, 3)
    assert refused.status == "fallback_reprefill" and "verified length 0 (no measured length passed)" in refused.reason


def test_without_evidence_the_factor_rule_guards_and_evidence_supersedes_it(pair):
    short = replace(pair.exact, manifest=pair.exact.manifest | {"calibration": {"seq_len": 2}})  # factor: 16 tokens
    assert switch(pair, short, 16).path == "map"
    beyond = switch(pair, short, 17)
    assert beyond.status == "fallback_reprefill" and "beyond 8 × the mapper's calibration length 2" in beyond.reason
    measured_long = with_evidence(pair, evidence([measured(0, 32, 20)], [32], 1.0, 300, UNSAVED), calibrated=2)
    assert switch(pair, measured_long, 20).path == "map"  # the evidence reaches past 8 × 2
    factor = switch(pair, measured_long, 20, length_guard="factor")
    assert factor.status == "fallback_reprefill" and "calibration length 2" in factor.reason
    assert switch(pair, short, 17, max_length_factor=None).path == "map"


@pytest.mark.parametrize("guard", [False, "none", None])
def test_a_length_guard_that_is_not_one_of_the_modes_is_refused(guard):
    quoted = " (YAML reads a bare off as false: quote it)" if guard is False else ""
    with pytest.raises(
        ValueError, match="policy length_guard must be one of .*, not " + re.escape(f"{guard!r}{quoted}")
    ):
        Policy(length_guard=guard)


# ---------------------------------------------------------------- end to end on the tiny random pair


def test_a_routed_run_records_the_mapper_it_ran_and_its_evidence_guards_the_next(tmp_path, monkeypatch):
    """fewshot_long on validation items (tiny random pair, CPU) → its record names the coefficients → the evidence
    command reads it into the cached mapper → a route bound to it refuses past the verified length. Random weights
    make no quality claim: the command refuses the record as it is, and reads a copy tagged real (plumbing only)."""
    if not (DATA / "eval").is_dir():
        pytest.skip("shared data not found")
    from hydra import compose, initialize_config_dir

    monkeypatch.setenv("KVRELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(src.pipeline, "_MEMO", {})
    overrides = [
        "+experiment=routed", "+workload=fewshot_long", "workload.split=valid", "workload.limit=4",
        "workload.tasks=[arc_easy]", "workload.shots={arc_easy: [1, 4]}", "workload.rollback_items=1",
        "workload.rollback_tokens=2", "budget.sequences=8", "budget.seq_len=64", f"paths.data={DATA}",
        "tracking.backend=json", f"tracking.json_dir={tmp_path / 'records'}",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("run", overrides=overrides)
    src.routed.routed(cfg)
    (run,) = (tmp_path / "records").glob("*/record.json")
    (directory,) = (tmp_path / "home/mappers").iterdir()
    mapper = load_mapper(directory)
    body = json.loads(run.read_text())
    assert body["tags"]["mapper_tensor_sha256"] == mapper.manifest["tensor_sha256"]
    with pytest.raises(ValueError, match="random weights make no quality claim"):
        add_evidence(directory, [run], [4096], 100.0, 1)
    body["tags"]["weights"] = "real"
    run.write_text(json.dumps(body))
    block = add_evidence(directory, [run], [4096], 100.0, 1)  # one bin, a margin no loss exceeds: plumbing
    histories = sorted(row["history_tokens"] for row in json.loads((run.parent / "artifacts/routed/items.json")
                       .read_text())["items"])  # fmt: skip
    assert block["max_verified_length"] == histories[-1] and sum(r["items"] for r in block["measurements"]) == 4
    pair = src.pipeline.load(cfg)
    route = bind(pair.source, pair.target, load_mapper(directory), pair.tokenizer_hash)
    assert route.verified_length == histories[-1] and route.verified_by.startswith(run.parent.name)
