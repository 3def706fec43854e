"""Item shards of a routed run (`workload.shards`, src/routed_workloads.py `shard`) and their join (src/routed_merge.py):
on the tiny random pair, the shards of a run joined score exactly what the unsharded run scores — the same items in
the same order, so the same accuracies and bootstrap CIs —, the join refuses what is not one run's shards, and the
gate never judges a shard alone."""

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest

from src.gate import is_shard
from src.records import ITEMS, RecordError, pack
from src.routed_merge import _joined, interleave, main, merge, write
from src.routed_workloads import check_shard, shard
from src.tasks import Item
from src.workloads import Example
from tests.test_routed import DATA, compose

TINY = (
    "workload=fewshot", "workload.tasks=[arc_easy,piqa]", "workload.limit=3", "workload.shots.arc_easy=2",
    "workload.shots.piqa=2", "workload.rollback_items=1", "workload.rollback_tokens=2", "budget.sequences=8",
    "budget.seq_len=64", "tracking.backend=json",
)  # fmt: skip


def test_shards_partition_each_tasks_items():
    examples = [Example(f"{task}{n}", Item(task, n, ["a"], ["b"], 0)) for task in ("x", "y") for n in range(5)]
    parts = [shard(examples, i, 3) for i in range(3)]
    assert [[(e.item.task, e.item.index) for e in part] for part in parts][1] == [
        ("x", 1),
        ("x", 4),
        ("y", 1),
        ("y", 4),
    ]
    assert sorted(e.history for part in parts for e in part) == sorted(e.history for e in examples)
    rows = [[{"task": e.item.task, "index": e.item.index} for e in part] for part in parts]
    assert interleave(rows) == [{"task": e.item.task, "index": e.item.index} for e in examples]  # the run's order
    for index, count in ((3, 3), (-1, 2), (0, 0), (True, 2), (0, 2.0)):
        with pytest.raises(ValueError, match="workload.shard"):
            check_shard(index, count)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """The tiny random pair's few-shot run, unsharded and as two shards: {name: record folder}."""
    if not (DATA / "eval").is_dir():
        pytest.skip("shared data not found")
    import src.pipeline
    from src.routed import routed

    root = tmp_path_factory.mktemp("shards")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("KVRELAY_HOME", str(root / "home"))
    found = {}
    try:
        for name, overrides in {"whole": (), "0": ("workload.shards=2", "workload.shard=0"),
                                "1": ("workload.shards=2", "workload.shard=1")}.items():  # fmt: skip
            routed(compose(*TINY, f"paths.data={DATA}", f"tracking.json_dir={root / name}", *overrides))
            (found[name],) = [p.parent for p in (root / name).glob("*/record.json")]
    finally:
        monkeypatch.undo()
        src.pipeline._MEMO.clear()
    return found


def metrics_of(record: dict) -> dict[str, float]:
    return {m["key"]: m["value"] for m in record["metrics"] if m["step"] is None}


def test_joined_shards_score_what_the_unsharded_run_scores(records, tmp_path):
    with pytest.raises(ValueError, match="not sharded"):  # refused before any model is loaded
        from src.routed import routed

        routed(compose("workload=multiturn", "workload.shards=2", f"paths.data={DATA}"))
    record, document = merge([records["1"], records["0"]])  # in any order
    whole = json.loads((records["whole"] / "record.json").read_text())
    items = json.loads((records["whole"] / "artifacts/routed/items.json").read_text())["items"]
    assert [(r["task"], r["index"]) for r in document["items"]] == [(r["task"], r["index"]) for r in items]
    joined, alone = metrics_of(record), metrics_of(whole)
    quality = [k for k in alone if k.startswith("task.")]
    assert quality and json.dumps({k: joined[k] for k in quality}) == json.dumps({k: alone[k] for k in quality})
    # the CIs too, bit for bit (NaN where random weights leave no gap to recover)
    for key in ("scored_turns", "handoffs.applied", "prefill_fraction", "rollback_verified", "throughput.items"):
        assert joined[key] == alone[key], key
    assert {"ttft_speedup_low", "ttft.routed_ms_p50", "throughput.routed_items_per_s"} <= set(joined)
    shard_tags = json.loads((records["0"] / "record.json").read_text())["tags"]
    assert shard_tags["shard"] == "0/2" and is_shard(shard_tags) and not is_shard(record["tags"])
    assert record["tags"]["merged_shards"] == "2" and record["params"]["workload.shard"] == "all"
    assert main([str(tmp_path / "out"), str(records["0"]), str(records["1"])]) == 0
    (folder,) = (tmp_path / "out").iterdir()
    assert json.loads((folder / "record.json").read_text()) == json.loads(json.dumps(record))
    assert (folder / "artifacts/config.yaml").read_text().startswith("# joined from 2 shards")
    from src.report.routed_tables import decision
    from src.report.rows import record_rows

    assert len(decision(record_rows(tmp_path / "out")).splitlines()) == 3  # header, rule, the joined run
    shutil.copytree(records["0"], tmp_path / "part" / records["0"].name)
    assert len(decision(record_rows(tmp_path / "part")).splitlines()) == 2  # a shard alone is never judged
    assert (
        _joined("rollback_verified", [1.0, 0.0], 2) == 0.0 and _joined("rollback.x.cache_max_abs_diff", [0, 2], 2) == 2
    )


def _copy(folder: Path, into: Path, edit, file: str = "record.json") -> Path:
    """A copy of the shard at `folder` whose `file` (its record, or its items artifact) `edit` changed."""
    target = into / folder.name
    shutil.copytree(folder, target)
    path = target / file
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))
    return target


def test_the_join_refuses_what_is_not_one_runs_shards(records, tmp_path, capsys):
    zero, one = records["0"], records["1"]
    with pytest.raises(ValueError, match="exactly once"):
        merge([zero])
    with pytest.raises(ValueError, match="exactly once"):
        merge([zero, zero])
    with pytest.raises(ValueError, match="no 'shard'"):
        merge([records["whole"], zero])
    reseeded = _copy(one, tmp_path / "a", lambda r: r["params"].update({"seed": "7"}))
    with pytest.raises(ValueError, match=r"params \['seed'\]"):
        merge([zero, reseeded])
    other_model = _copy(one, tmp_path / "b", lambda r: r["tags"].update({"target_fingerprint": "0" * 64}))
    with pytest.raises(ValueError, match=r"tags \['target_fingerprint'\]"):
        merge([zero, other_model])
    other_code = _copy(one, tmp_path / "b2", lambda r: r["tags"].update({"code_digest": "0" * 16}))
    with pytest.raises(ValueError, match=r"tags \['code_digest'\]"):
        merge([zero, other_code])
    unknown_code = _copy(one, tmp_path / "b3", lambda r: r["tags"].pop("code_digest"))
    with pytest.raises(ValueError, match="no code_digest tag"):
        merge([zero, unknown_code])
    other_card = _copy(one, tmp_path / "b4", lambda r: r["tags"].update({"gpu": "NVIDIA H200"}))
    with pytest.raises(ValueError, match=r"tags \['gpu'\]"):
        merge([zero, other_card])
    unfinished = _copy(one, tmp_path / "c", lambda r: r.update({"status": "FAILED"}))
    with pytest.raises(ValueError, match="only finished"):
        merge([zero, unfinished])
    extra = {"key": "mystery", "value": 1.0, "step": None, "timestamp": 0}
    partial = _copy(one, tmp_path / "d", lambda r: r["metrics"].append(extra))
    with pytest.raises(ValueError, match="some shards only"):
        merge([zero, partial])
    both = [_copy(f, tmp_path / "e", lambda r: r["metrics"].append(extra)) for f in (zero, one)]
    with pytest.raises(ValueError, match="no rule"):
        merge(both)
    counts = json.loads((zero / "record.json").read_text())["metrics"]  # its record agrees with its rows
    overlapping = _copy(one, tmp_path / "f", lambda r: r.update({"metrics": counts}))
    shutil.copy(zero / "artifacts/routed/items.json", overlapping / "artifacts/routed/items.json")
    with pytest.raises(ValueError, match="overlap"):
        merge([zero, overlapping])
    assert main([str(tmp_path / "out"), str(zero)]) == 2 and "exactly once" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing half-written
    record, document = merge([zero, one])
    with pytest.raises(FileNotFoundError):
        write(tmp_path / "g", record, document, tmp_path / "no-config.yaml")
    assert not any((tmp_path / "g").iterdir())  # the staging folder went with the failure


def test_packed_shards_join_as_the_plain_ones(records, tmp_path):
    """Committed shards keep their items packed (items.json.gz, `src.tracking pack`): they join to the same record
    and rows, and a row without a key is named in the packed file."""
    packed = [shutil.copytree(records[n], tmp_path / n / records[n].name) for n in ("0", "1")]
    assert len(pack([tmp_path])) == 2
    assert json.dumps(merge(packed)) == json.dumps(merge([records["0"], records["1"]]))
    document = json.loads(gzip.decompress((packed[1] / f"{ITEMS}.gz").read_bytes()))
    document["items"][0].pop("task")
    (packed[1] / f"{ITEMS}.gz").write_bytes(gzip.compress(json.dumps(document).encode()))
    with pytest.raises(RecordError, match=r"items\.json\.gz items\[0\]: no 'task'"):
        merge(packed)


def test_shards_of_one_code_from_two_leases_join_and_name_both_commits(records, tmp_path):
    """A run's shards may span leases: the commits their trees named may differ (docs, tests, scripts changed between
    leases) as long as the code digest is one; the joined record names every commit."""
    later = _copy(records["1"], tmp_path, lambda r: r["tags"].update({"git_commit": "f" * 40,
                                                                                            "git_dirty": "True"}))  # fmt: skip
    record, _ = merge([records["0"], later])
    first = json.loads((records["0"] / "record.json").read_text())["tags"]
    assert record["tags"]["merged_commits"] == ",".join(sorted({first["git_commit"], "f" * 40}))
    assert record["tags"]["git_dirty"] == "True" and record["tags"]["code_digest"] == first["code_digest"]


def test_a_shard_whose_rows_disagree_with_its_record_or_lack_a_key_is_refused(records, tmp_path, capsys):
    """Issue 32 item 5: a shard that lost an item row or a handoff record (its counts disagree with its own record's)
    is refused, naming the shard and both counts; a row without a key the join reads is refused naming the file, the
    row and the key — never a bare KeyError; nothing is written."""
    zero, one = records["0"], records["1"]
    lost = _copy(one, tmp_path / "lost", lambda d: d["items"].pop(), ITEMS)
    rows = json.loads((one / "artifacts/routed/items.json").read_text())["items"]
    task = rows[-1]["task"]
    count = sum(row["task"] == task for row in rows)
    message = rf"shard 1/2 holds {count - 1} item rows of {task}, its record logged task\.{task}\.items = {count}"
    with pytest.raises(ValueError, match=message):
        merge([zero, lost])
    added = _copy(one, tmp_path / "added", lambda d: d["items"].append(d["items"][0] | {"index": 99}), ITEMS)
    with pytest.raises(ValueError, match="a row was lost or added"):
        merge([zero, added])
    dropped = _copy(one, tmp_path / "dropped", lambda d: d["handoffs"].pop(), ITEMS)
    with pytest.raises(ValueError, match=r"shard 1/2's handoff records count handoffs\.\S+ \d+ \(logged \d+\)"):
        merge([zero, dropped])
    keyless = _copy(one, tmp_path / "keyless", lambda d: d["items"][0].pop("task"), ITEMS)
    with pytest.raises(RecordError, match=r"items\.json items\[0\]: no 'task'"):
        merge([zero, keyless])
    moves = _copy(one, tmp_path / "moves", lambda d: d["handoffs"][0].pop("status"), ITEMS)
    with pytest.raises(RecordError, match=r"items\.json handoffs\[0\]: no 'status'"):
        merge([zero, moves])
    assert main([str(tmp_path / "out"), str(zero), str(keyless)]) == 2
    assert re.fullmatch(r"routed_merge: \S+items\.json items\[0\]: no 'task' \(.*\)\n", capsys.readouterr().err)
    assert main([str(tmp_path / "out"), str(zero), str(lost)]) == 2 and "rerun the shard" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything was written
