"""Tracking as its users meet it: experiments open on the runs table, a run spans the job it records (times, system
metrics), a job that raises leaves a FAILED run with the error, JSON records survive import → export, and items
stored packed (items.json.gz, as committed) read, import and gate exactly as the plain JSON."""

import gzip
import json
import shutil
import time
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from src import mlflow_store, records, tracking
from src.records import ITEMS, RecordError

INTERVAL_ENV = "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict[str, str]:
    """One sqlite store for the module (creating one costs seconds)."""
    root = tmp_path_factory.mktemp("tracking")
    return {"uri": f"sqlite:///{root / 'mlflow.db'}", "artifacts": str(root / "artifacts"), "root": str(root)}


@pytest.fixture(autouse=True)
def restore_interval(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "10")  # a test's interval must not leak into other test files
    monkeypatch.delenv(INTERVAL_ENV)


def cfg(store, experiment: str, backend: str = "mlflow", **tracking_overrides):
    node = {"backend": backend, "experiment": experiment, "uri": store["uri"], "artifacts": store["artifacts"]}
    node |= {"json_dir": f"{store['root']}/records/{experiment}", "system_metrics_s": 0} | tracking_overrides
    return OmegaConf.create({"tracking": node, "fit": {"k": 4}})


def only_run(store, experiment: str):
    client = MlflowClient(store["uri"])
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def record_of(config) -> dict:
    (path,) = Path(config.tracking.json_dir).glob("*/record.json")
    return json.loads(path.read_text()) | {"_dir": str(path.parent)}


def test_experiment_is_a_model_training_one(store):
    with tracking.job_run(cfg(store, "kind"), "job", {"job": "fit_eval"}) as run:
        pass
    experiment = MlflowClient(store["uri"]).get_experiment_by_name("kind")
    assert experiment.tags[mlflow_store.EXPERIMENT_KIND_TAG] == "custom_model_development"
    # MLflow 3.17's UI picks its GenAI / Model-training view from the URL: the printed link asks for the runs table
    assert f"/#/experiments/{experiment.experiment_id}?workflowType=machine_learning" in run.where()


def test_kind_added_to_an_old_experiment_but_a_chosen_kind_stays(store):
    client = MlflowClient(store["uri"])
    client.create_experiment("old")  # made before the tag existed
    client.set_experiment_tag(client.create_experiment("chosen"), mlflow_store.EXPERIMENT_KIND_TAG, "genai_development")
    mlflow_store.configure(store["uri"], "old", store["artifacts"])
    mlflow_store.configure(store["uri"], "chosen", store["artifacts"])
    assert client.get_experiment_by_name("old").tags[mlflow_store.EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert client.get_experiment_by_name("chosen").tags[mlflow_store.EXPERIMENT_KIND_TAG] == "genai_development"


@pytest.mark.parametrize("backend", ["mlflow", "json"])
def test_run_spans_the_job(store, backend):
    config = cfg(store, f"span_{backend}", backend)
    began = time.time() * 1000
    with tracking.job_run(config, "job", {"job": "fit_eval"}) as run:
        time.sleep(0.3)
        run.metrics({"r2_k_heldout": 0.5})
    ended = time.time() * 1000
    if backend == "mlflow":
        info = only_run(store, config.tracking.experiment).info
        start, end, status = info.start_time, info.end_time, info.status
    else:
        record = record_of(config)
        start, end, status = record["start_time"], record["end_time"], record["status"]
    assert status == "FINISHED"
    assert began - 5 <= start and end <= ended + 5 and end - start >= 300


@pytest.mark.parametrize("backend", ["mlflow", "json"])
def test_a_job_that_raises_leaves_a_failed_run(store, backend):
    config = cfg(store, f"failed_{backend}", backend)
    with pytest.raises(ValueError, match="boom"):
        with tracking.job_run(config, "job", {"job": "fit_eval"}) as run:
            run.metrics({"r2_k_heldout": 0.5})
            raise ValueError("boom: the pair has no shared tokenizer")
    if backend == "mlflow":
        found = only_run(store, config.tracking.experiment)
        status, tags = found.info.status, found.data.tags
        text = MlflowClient(store["uri"]).download_artifacts(found.info.run_id, "error.txt", store["root"])
        text = open(text).read()
        assert mlflow.active_run() is None
    else:
        record = record_of(config)
        status, tags = record["status"], record["tags"]
        text = open(f"{record['_dir']}/artifacts/error.txt").read()
    assert status == "FAILED" and tags["error"] == "ValueError: boom: the pair has no shared tokenizer"
    assert "Traceback" in text and "raise ValueError" in text


def test_system_metrics_cover_the_job(store):
    config = cfg(store, "system", system_metrics_s=0.1)
    with tracking.job_run(config, "job", {"job": "fit_eval"}):
        time.sleep(0.5)
    found = only_run(store, "system")
    assert found.data.tags["system_metrics"] == "psutil"
    assert "system/cpu_utilization_percentage" in found.data.metrics


def test_nested_under_the_multirun_parent(store):
    mlflow_store.configure(store["uri"], "nested", store["artifacts"])
    with mlflow.start_run(run_name="sweep:nested") as parent:
        with tracking.job_run(cfg(store, "nested"), "child", {"job": "fit_eval"}):
            pass
        assert mlflow.active_run().info.run_id == parent.info.run_id  # the child ended, not the parent
    client = MlflowClient(store["uri"])
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("nested").experiment_id])}
    assert runs["child"].data.tags["mlflow.parentRunId"] == parent.info.run_id


def test_json_record_renamed_then_imported_and_exported_unchanged(store, tmp_path):
    config = cfg(store, "round_trip", "json")
    with tracking.job_run(config, "tiny:job", {"job": "fit_eval"}) as run:
        run.metrics({"r2_k_heldout": 0.25, "nll_transfer": 5.5})
        run.metrics({"ttft_ms_p50": 3.0}, step=16)
        run.metrics({"ttft_ms_p50": 4.0}, step=32)
        run.dict({"items": [1, 0, 1]}, "tasks/item_scores.json")
        run.tags({"method": "head_local"})
        run.rename("tiny:head_local:k4")
    record = record_of(config)
    assert record["name"] == "tiny:head_local:k4" and record["_dir"].rsplit("/", 1)[1].startswith("tiny_head_local_k4-")
    assert record["tags"]["method"] == "head_local" and record["params"]["fit.k"] == "4"
    assert f"{record['_dir']}/record.json" in run.where()
    assert mlflow_store.import_records(config.tracking.json_dir, store["uri"], store["artifacts"]) == 1
    assert mlflow_store.import_records(config.tracking.json_dir, store["uri"], store["artifacts"]) == 0  # already there
    imported = only_run(store, "round_trip")
    assert (imported.info.start_time, imported.info.end_time) == (record["start_time"], record["end_time"])
    assert imported.info.status == "FINISHED" and imported.info.run_name == "tiny:head_local:k4"
    assert mlflow_store.export_records("round_trip", tmp_path / "out", store["uri"]) == 1
    (path,) = (tmp_path / "out").glob("*/record.json")
    exported = json.loads(path.read_text())
    for key in ("name", "experiment", "status", "start_time", "end_time", "params"):
        assert exported[key] == record[key], key
    assert {k: v for k, v in exported["tags"].items() if k not in ("imported_from", "imported_digest")} == record[
        "tags"
    ]
    metric = lambda m: (m["key"], m["value"], m["step"] or 0)  # MLflow stores an unstepped metric at step 0
    assert sorted(map(metric, exported["metrics"])) == sorted(map(metric, record["metrics"]))
    assert json.loads((path.parent / "artifacts/tasks/item_scores.json").read_text()) == {"items": [1, 0, 1]}


def test_runs_logged_with_the_old_policy_keys_read_under_todays(store):
    """A run an MLflow store holds from before 2026-12-05 (`eval.levers.*`, `workload.policy`, …) reads as today's
    `policy.*` in the store's table rows (src/report/rows.py `mlflow_rows`), as read_record gives a JSON record's."""
    from src.report.rows import mlflow_rows

    experiment = mlflow_store.configure(store["uri"], "old_keys", store["artifacts"])
    client = MlflowClient(store["uri"])
    run_id = client.create_run(experiment, run_name="old").info.run_id
    old = {"eval.levers.recompute": "0.25", "workload.policy": "auto", "workload.max_length_factor": "8.0",
           "workload.guard_max_abs": "None", "workload.escalation.policy": "none", "fit.k": "4"}  # fmt: skip
    for key, value in old.items():
        client.log_param(run_id, key, value)
    client.set_terminated(run_id, "FINISHED")
    (row,) = mlflow_rows(store["uri"], ["old_keys"])
    params = {key.removeprefix("params."): value for key, value in row.items() if key.startswith("params.")}
    assert params == records.current_params(old) == {
        "policy.levers.recompute": "0.25", "policy.mode": "auto", "policy.max_length_factor": "8.0",
        "policy.guard_max_abs": "None", "workload.escalation.policy": "none", "fit.k": "4",
    }  # fmt: skip


def test_code_digest_names_the_code_a_run_ran(tmp_path):
    """The digest covers src/, kernels/ and conf/ (not caches), changes with one byte, and `digest_at` reproduces it
    from a commit: a record's `code_digest` tag says which commit's code ran even where git metadata is stale."""
    import subprocess

    for name, text in (("src/a.py", "x = 1\n"), ("kernels/k.py", "y = 2\n"), ("conf/c.yaml", "z: 3\n")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    git = lambda *args: subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    first = tracking.code_digest(tmp_path)
    assert tracking.digest_at("HEAD", tmp_path) == first and len(first) == 16
    (tmp_path / "src/__pycache__").mkdir()
    (tmp_path / "src/__pycache__/a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "README.md").write_text("not code\n")
    assert tracking.code_digest(tmp_path) == first
    (tmp_path / "conf/c.yaml").write_text("z: 4\n")
    assert tracking.code_digest(tmp_path) != first == tracking.digest_at("HEAD", tmp_path)
    assert tracking.environment_tags()["code_digest"] == tracking.code_digest()


def test_timing_environment_is_recorded_where_set(monkeypatch):
    """A run under PYTORCH_CUDA_ALLOC_CONF (or another knob that changes timings) says so in its tags."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert "env.PYTORCH_CUDA_ALLOC_CONF" not in tracking.environment_tags()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert tracking.environment_tags()["env.PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_code_digest_of_an_unknown_revision_is_a_clear_error():
    with pytest.raises(ValueError, match="no code digest at 'no-such-revision'"):
        tracking.digest_at("no-such-revision")


# --- items stored packed (items.json.gz): read, packed and imported as the plain JSON ------------------------------

ROWS = [{"task": "arc_easy", "index": n, "ttft": {"routed": 1.5 * n, "reprefill": 3.25 * n}} for n in range(50)]


def items_run(folder: Path, rows: list[dict] = ROWS) -> Path:
    """A record folder holding only a plain items artifact of `rows` (indented, as other JSON writers might)."""
    (folder / ITEMS).parent.mkdir(parents=True)
    (folder / ITEMS).write_text(json.dumps({"items": rows, "handoffs": []}, indent=1))
    return folder


def test_packed_items_read_as_the_plain_ones(tmp_path):
    plain, packed = items_run(tmp_path / "plain"), items_run(tmp_path / "packed")
    original = (packed / ITEMS).read_bytes()
    assert records.pack([packed]) == [packed / f"{ITEMS}.gz"] and not (packed / ITEMS).exists()
    assert records.items_path(plain) == plain / ITEMS and records.items_path(packed) == packed / f"{ITEMS}.gz"
    assert gzip.decompress((packed / f"{ITEMS}.gz").read_bytes()) == original  # the very bytes
    assert records.read_items(packed) == records.read_items(plain) == ROWS
    assert records.read_json(packed / f"{ITEMS}.gz") == records.read_json(plain / ITEMS)
    assert records.items_path(tmp_path / "none") == tmp_path / "none" / ITEMS  # neither: the plain name, not a file
    with pytest.raises(RecordError, match=r"none/artifacts/routed/items\.json: no such file"):
        records.read_items(tmp_path / "none")


def test_items_both_plain_and_packed_are_refused_naming_both(tmp_path):
    run = items_run(tmp_path / "run")
    (run / f"{ITEMS}.gz").write_bytes(gzip.compress(json.dumps({"items": ROWS[:1]}).encode()))  # they disagree
    both = rf"{run / ITEMS} and {run / ITEMS}\.gz: both present"
    for reader in (records.items_path, records.read_items):
        with pytest.raises(RecordError, match=both):
            reader(run)
    assert records.pack([run]) == [run / f"{ITEMS}.gz"] and records.read_items(run) == ROWS  # the plain one wins


def test_a_damaged_packed_file_is_named(tmp_path):
    run = items_run(tmp_path / "run")
    (path,) = records.pack([run])
    blob = path.read_bytes()
    cut, flipped = blob[: len(blob) // 2], blob[:-8] + bytes(8)  # a cut stream; a stream whose CRC and size lie
    for damaged in (cut, flipped, b"{not gzip}", gzip.compress(b'{"items": [')):
        path.write_bytes(damaged)
        with pytest.raises(RecordError, match=rf"{path}: not (a valid gzip file|valid JSON), truncated or damaged"):
            records.read_items(run)


def test_pack_is_idempotent_and_gives_the_same_bytes_for_the_same_json(tmp_path, monkeypatch):
    runs = [items_run(tmp_path / "set" / name) for name in ("a", "b")]
    written = records.pack([tmp_path / "set", runs[0]])  # a folder named twice is packed once
    assert written == [run / f"{ITEMS}.gz" for run in runs]
    blobs = [path.read_bytes() for path in written]
    assert blobs[0] == blobs[1] and blobs[0][4:8] == bytes(4)  # no time in the gzip header: reproducible bytes
    assert records.pack([tmp_path / "set"]) == [] and [path.read_bytes() for path in written] == blobs
    assert sorted(p.name for p in (tmp_path / "set").glob("**/*") if p.is_file()) == ["items.json.gz"] * 2
    compress = gzip.compress
    monkeypatch.setattr(records.gzip, "compress", lambda data, **kwargs: compress(data[:-1], mtime=0))
    lossy = items_run(tmp_path / "lossy")  # a gzip that does not give back the bytes: refused, nothing changed
    with pytest.raises(RecordError, match="does not give back the same bytes; left unpacked"):
        records.pack([lossy])
    assert [p.name for p in (lossy / ITEMS).parent.iterdir()] == ["items.json"]
    with pytest.raises(ValueError, match="no-such: no such folder"):  # a mistyped folder is named, nothing packed
        records.pack([lossy, tmp_path / "no-such"])


def test_import_logs_packed_items_as_their_json_and_the_gate_reads_them(store, tmp_path, capsys):
    """src/gate.py downloads routed/items.json from MLflow: a packed record imports its items under that name, the
    very bytes of the plain file, and the gate judges the run from them."""
    from mlflow.artifacts import download_artifacts

    from src.gate import check
    from tests.gate_records import passing, run, write_record

    folder = write_record(tmp_path / "records", run(passing()))
    record = json.loads((folder / "record.json").read_text())
    (folder / "record.json").write_text(json.dumps(record | {"experiment": "packed_items"}))
    original = (folder / ITEMS).read_bytes()
    assert len(records.pack([tmp_path / "records"])) == 1
    assert mlflow_store.import_records(tmp_path / "records", store["uri"], store["artifacts"]) == 1
    run_id = only_run(store, "packed_items").info.run_id
    assert [a.path for a in MlflowClient(store["uri"]).list_artifacts(run_id, "routed")] == ["routed/items.json"]
    downloaded = download_artifacts(run_id=run_id, artifact_path="routed/items.json", dst_path=str(tmp_path / "dl"))
    assert Path(downloaded).read_bytes() == original
    plans = tmp_path / "plans.yaml"
    plans.write_text(json.dumps({"since": "2026-12-06T00:00:00+00:00", "plans": []}))
    check(store["uri"], "packed_items", plans=plans)
    out = capsys.readouterr().out  # judged from its 200 item rows (without them: MISSING, "no items artifact")
    assert "PASS         record: logged = items             measured 86 logged metrics equal their recomputation " \
           "from 200 rows" in out and "quality: loss vs all-re-prefill    measured arc_easy +0.00" in out  # fmt: skip


def test_import_refuses_a_damaged_or_doubled_packed_artifact_and_imports_nothing(store, tmp_path):
    from tests.gate_records import passing, run, write_record

    for name, fault in (("cut", "not a valid gzip file"), ("doubled", "both present")):
        folder = write_record(tmp_path / name, run(passing(10)))
        record = json.loads((folder / "record.json").read_text())
        (folder / "record.json").write_text(json.dumps(record | {"experiment": f"packed_{name}"}))
        shutil.copytree(folder, tmp_path / name / "good")  # a good record beside it: not imported either
        (packed,) = records.pack([folder])
        if name == "cut":
            packed.write_bytes(packed.read_bytes()[:100])
        else:
            (folder / ITEMS).write_text("{}")
        with pytest.raises(RecordError, match=fault):
            mlflow_store.import_records(tmp_path / name, store["uri"], store["artifacts"])
        assert MlflowClient(store["uri"]).get_experiment_by_name(f"packed_{name}") is None
