"""The MLflow store (`sqlite:///mlruns/mlflow.db`; MLflow ≥ 3.13 refuses the plain file store) and the moves between it
and JSON records (record.json + artifacts/, the `json` tracking backend's folders, src/records.py):

    configure(uri, experiment, artifacts)        # the store and its experiment, tagged to open on the runs table
    import_records(directory, uri, artifacts)    # every record under directory replayed as a run (once)
    export_records(experiment, directory, uri)   # an experiment's runs written as records (e.g. results/NAME)

A job's own run, and the command line over these (`python -m src.tracking import|export`), are src/tracking.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from src.records import PACKED, read_record, record_digest, record_dir, require, stored, unpacked

# MLflow 3 UIs open an experiment without this tag on the GenAI overview (traces); "custom_model_development" opens
# the runs table and charts (the value the UI's own experiment-kind selector writes). MLflow 3.17's UI ignores the tag
# for its global GenAI / Model-training switch, which a URL sets with UI_VIEW (the browser then remembers it).
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
UI_VIEW = "workflowType=machine_learning"
ARTIFACT_EXPORT_BYTES = 1 << 20  # `export` copies artifacts up to this size (records stay small; never weights)


def configure(uri: str, experiment: str, artifacts: str) -> str:
    """Point MLflow at the sqlite store, create the experiment (artifacts under `artifacts`) tagged as a
    model-training experiment, make it the active one; returns its id."""
    import mlflow

    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    found = mlflow.get_experiment_by_name(experiment)
    if found is None:
        location = Path(artifacts).resolve().as_uri()
        experiment_id = mlflow.create_experiment(experiment, location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    else:
        experiment_id = found.experiment_id
        if EXPERIMENT_KIND_TAG not in found.tags:  # made before this tag existed; a kind chosen in the UI stays
            mlflow.MlflowClient().set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def import_records(directory: str | Path, uri: str, artifacts: str) -> int:
    """Replay every JSON record under `directory` as an MLflow run (times and status kept, params under today's names:
    `read_record`); returns how many. A record already imported into its experiment (tag `imported_digest`: the
    sha256 of its record.json) is skipped, so importing a folder twice adds nothing. A truncated record, or one without
    a key the replay needs, is a RecordError naming it, before anything is replayed."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    records = [(path, read_record(path)) for path in sorted(Path(directory).glob("**/record.json"))]
    for path, record in records:  # every record checked before any is imported: a bad one imports nothing
        require(record, "experiment", path)
        for file in _artifacts(path.parent):
            if file.name.endswith(PACKED):
                stored(file.with_name(file.name.removesuffix(PACKED)))  # not beside its plain copy
                unpacked(file)  # a whole gzip
    client, imported = MlflowClient(uri), 0
    for path, record in records:
        experiment_id = configure(uri, record["experiment"], artifacts)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        if client.search_runs([experiment_id], f"tags.imported_digest = '{digest}'", max_results=1):
            continue
        imported += 1
        start = record.get("start_time") or int(time.time() * 1000)  # records from before issue 15 have no times
        tags = record["tags"] | {"imported_from": str(path.parent), "imported_digest": digest}
        run_id = client.create_run(experiment_id, start_time=start, tags=tags, run_name=record["name"]).info.run_id
        metrics = [Metric(m["key"], m["value"], m.get("timestamp") or start, m["step"] or 0) for m in record["metrics"]]
        client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in record["params"].items()])
        with tempfile.TemporaryDirectory(prefix="kvrelay-import-") as scratch:
            for file in _artifacts(path.parent):
                relative = file.parent.relative_to(path.parent / "artifacts")
                if file.name.endswith(PACKED):  # logged as its plain JSON (src/gate.py reads routed/items.json)
                    plain = Path(scratch) / file.name.removesuffix(PACKED)
                    plain.write_bytes(unpacked(file))
                    file = plain
                client.log_artifact(run_id, str(file), None if str(relative) == "." else str(relative))
        status = record.get("status", "FINISHED")
        client.set_terminated(run_id, "FAILED" if status == "RUNNING" else status, record.get("end_time") or start)
    return imported


def _artifacts(record: Path) -> list[Path]:
    """The artifact files of the record folder `record` (under its artifacts/), in order."""
    return [file for file in sorted((record / "artifacts").glob("**/*")) if file.is_file()]


def export_records(experiment: str, directory: str | Path, uri: str) -> int:
    """Write every run of `experiment` as a JSON record under `directory` (the layout `import` reads); metrics keep
    their steps, system metrics are left out, artifacts over ARTIFACT_EXPORT_BYTES too. Returns how many."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ValueError(f"no experiment {experiment!r} in {uri}")
    runs = client.search_runs([found.experiment_id], max_results=50_000, order_by=["attributes.start_time ASC"])
    for run in runs:
        info, data = run.info, run.data
        history = [
            {"key": m.key, "value": m.value, "step": m.step, "timestamp": m.timestamp}
            for key in sorted(data.metrics)
            if not key.startswith("system/")
            for m in client.get_metric_history(info.run_id, key)
        ]
        record = {
            "name": info.run_name,
            "experiment": experiment,
            "status": info.status,
            "start_time": info.start_time,
            "end_time": info.end_time,
            "params": dict(sorted(data.params.items())),
            "tags": {k: v for k, v in sorted(data.tags.items()) if not k.startswith("mlflow.")},
            "metrics": history,
        }
        target = record_dir(
            Path(directory), info.run_name, record_digest(record["params"])
        )  # named as the json backend
        if (target / "record.json").is_file():
            shutil.rmtree(target)  # a re-export replaces the record
        (target / "artifacts").mkdir(parents=True, exist_ok=True)
        (target / "record.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        _export_artifacts(client, info.run_id, "", target / "artifacts")
    return len(runs)


def _export_artifacts(client, run_id: str, path: str, target: Path) -> None:
    for item in client.list_artifacts(run_id, path or None):
        if item.is_dir:
            _export_artifacts(client, run_id, item.path, target)
        elif (item.file_size or 0) <= ARTIFACT_EXPORT_BYTES:
            folder = target / Path(item.path).parent
            folder.mkdir(parents=True, exist_ok=True)
            client.download_artifacts(run_id, item.path, str(folder))
