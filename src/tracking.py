"""Tracking: one run per job, open for the whole job (a child of the multirun's parent run); params = flattened
config, tags = everything needed to reproduce (fingerprints, git commit, library/CUDA/driver/GPU versions).

    with tracking.job_run(cfg, name, tags) as run:   # at the job's START: the run spans the job
        ...; run.metrics({...}); run.dict(items, "tasks/item_scores.json"); run.tags({...}); run.rename(final)

A job that raises leaves a FAILED run whose `error` tag holds the exception (traceback in `error.txt`).

Backend `mlflow` writes to the sqlite store (`sqlite:///mlruns/mlflow.db`; MLflow ≥ 3.13 refuses the plain file
store); experiments are tagged as model-training ones so MLflow 3 opens them on the runs table, and runs log system
metrics (psutil) every `tracking.system_metrics_s` seconds. Backend `json` writes the same record as files
(record.json + artifacts/, for the GPU machine without MLflow, and the committed records under results/).

The command line: `python -m src.tracking import DIR` replays records into the MLflow store (a packed `items.json.gz`
logged as its plain JSON), `export EXPERIMENT DIR` writes an experiment's runs as records (both src/mlflow_store.py),
`pack DIR` packs committed items, `digest [--rev REV]` prints the code digest a run's `code_digest` tag holds.
Reading records as data — `read_record`, `read_items`, `RecordError`, packed items — is src/records.py.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from src.mlflow_store import UI_VIEW, configure, export_records, import_records
from src.records import RecordError, pack, record_digest, record_dir


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("src", "kernels", "conf")  # what a run executes and reads as configuration
TIMING_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS")


def code_digest(root: Path = ROOT) -> str:
    """sha256 (16 hex) over the relative paths and bytes of every file under src/, kernels/ and conf/: names the code
    a run ran even where git metadata is stale (the device's copy of the tree keeps its first HEAD). Compare with a
    commit by `python -m src.tracking digest --rev REV`."""
    digest = hashlib.sha256()
    files = (path for name in CODE_DIRS for path in (root / name).rglob("*") if path.is_file())
    for path in sorted(p for p in files if "__pycache__" not in p.parts and p.suffix != ".pyc"):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def digest_at(rev: str, root: Path = ROOT) -> str:
    """`code_digest` of the tree at git revision `rev` of the repository at `root` (extracted with `git archive`)."""
    archive = subprocess.run(["git", "archive", rev, *CODE_DIRS], cwd=root, capture_output=True)
    if archive.returncode:
        raise ValueError(f"no code digest at {rev!r}: {archive.stderr.decode().strip()}")
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
        return code_digest(Path(folder))


def environment_tags() -> dict[str, str]:
    """Versions and hardware of this process: git, the code digest, Python, torch, transformers, CUDA, driver, GPU,
    and the environment variables that change timings or kernels (`env.<NAME>`, where set)."""
    tags = {
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": str(bool(_git("status", "--porcelain", "--untracked-files=no"))),
        "code_digest": code_digest(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": str(torch.version.cuda),
        "host": platform.machine(),
    } | {f"env.{name}": os.environ[name] for name in TIMING_ENV if name in os.environ}
    if torch.cuda.is_available():
        tags["gpu"] = torch.cuda.get_device_name()
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        tags["driver"] = smi.stdout.strip() or "unknown"
    return tags


def flatten(cfg: DictConfig) -> dict[str, str]:
    """Dotted keys → string values of the resolved config (the run's params)."""
    flat: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = str(node)[:6000]

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def _now_ms() -> int:
    return int(time.time() * 1000)


def _error_text(error: BaseException) -> tuple[str, str]:
    """(one line for the `error` tag, the full traceback for error.txt)."""
    line = f"{type(error).__name__}: {error}"[:5000]
    return line, "".join(traceback.format_exception(error))


class MLflowRecorder:
    """What a job logs, sent to its own MLflow run (opened at the job's start, ended by `close`)."""

    def __init__(self, cfg: DictConfig, name: str, tags: dict[str, str]):
        import mlflow

        configure(cfg.tracking.uri, cfg.tracking.experiment, cfg.tracking.artifacts)
        self.mlflow, self.client = mlflow, mlflow.MlflowClient()
        interval = cfg.tracking.system_metrics_s  # 0: off
        system_metrics = importlib.util.find_spec("psutil") is not None and interval != 0
        if system_metrics and interval:
            mlflow.set_system_metrics_sampling_interval(interval)
        run = mlflow.start_run(run_name=name, nested=mlflow.active_run() is not None, log_system_metrics=system_metrics)
        self.run_id, self.experiment_id, self.uri = run.info.run_id, run.info.experiment_id, cfg.tracking.uri
        mlflow.log_params(flatten(cfg), run_id=self.run_id)
        self.tags(tags | {"system_metrics": "psutil" if system_metrics else "off"})
        self.client.log_text(self.run_id, OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")

    def metrics(self, values: dict[str, float], step: int | None = None) -> None:
        self.mlflow.log_metrics(values, step=step, run_id=self.run_id)

    def tags(self, values: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(key, str(value)) for key, value in values.items()])

    def rename(self, name: str) -> None:
        self.client.set_tag(self.run_id, "mlflow.runName", name)

    def dict(self, value: dict, path: str) -> None:
        self.client.log_dict(self.run_id, value, path)

    def figure(self, figure, path: str) -> None:
        self.client.log_figure(self.run_id, figure, path)

    def close(self, status: str, error: BaseException | None = None) -> None:
        if error is not None:
            line, text = _error_text(error)
            self.tags({"error": line})
            self.client.log_text(self.run_id, text, "error.txt")
        if self._active():
            self.mlflow.end_run(status)  # also stops the system-metrics monitor
        else:  # the job ended its run itself or left a nested one open: end ours by id
            self.client.set_terminated(self.run_id, status)

    def where(self) -> str:
        """How to open this run's experiment on its runs table."""
        page = f"http://127.0.0.1:5000/#/experiments/{self.experiment_id}?{UI_VIEW}"
        return f"open the tracking UI: mlflow ui --backend-store-uri {self.uri}  then  {page}"

    def _active(self) -> bool:
        active = self.mlflow.active_run()
        return active is not None and active.info.run_id == self.run_id


class JsonRecorder:
    """What a job logs, kept as record.json + artifacts/ in `json_dir/<name>-<digest of the params>` (a rerun of
    the same config replaces its record); replayed into MLflow by `import`."""

    def __init__(self, cfg: DictConfig, name: str, tags: dict[str, str]):
        params = flatten(cfg)
        self.root, self.digest = Path(cfg.tracking.json_dir), record_digest(params)
        self.directory = record_dir(self.root, name, self.digest)
        if (self.directory / "record.json").is_file():
            shutil.rmtree(self.directory)
        self.record = {
            "name": name,
            "experiment": cfg.tracking.experiment,
            "status": "RUNNING",
            "start_time": _now_ms(),
            "end_time": None,
            "params": params,
            "tags": tags,
            "metrics": [],
        }
        self._artifact("config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        self.save()

    def metrics(self, values: dict[str, float], step: int | None = None) -> None:
        now = _now_ms()
        self.record["metrics"] += [
            {"key": k, "value": float(v), "step": step, "timestamp": now} for k, v in values.items()
        ]
        self.save()

    def tags(self, values: dict[str, str]) -> None:
        self.record["tags"] |= {key: str(value) for key, value in values.items()}
        self.save()

    def rename(self, name: str) -> None:
        self.record["name"] = name
        self.save()

    def dict(self, value: dict, path: str) -> None:
        self._artifact(path).write_text(json.dumps(value, separators=(",", ":"), default=str))  # records stay small

    def figure(self, figure, path: str) -> None:
        figure.savefig(self._artifact(path), dpi=120)

    def close(self, status: str, error: BaseException | None = None) -> None:
        self.record |= {"status": status, "end_time": _now_ms()}
        if error is not None:
            line, text = _error_text(error)
            self.record["tags"]["error"] = line
            self._artifact("error.txt").write_text(text)
        self.save()
        final = record_dir(self.root, self.record["name"], self.digest)
        if final != self.directory:  # renamed during the job: the folder follows the name
            if (final / "record.json").is_file():
                shutil.rmtree(final)
            self.directory = self.directory.rename(final)

    def where(self) -> str:
        return f"record: {self.directory / 'record.json'}  (into MLflow: python -m src.tracking import {self.root})"

    def _artifact(self, path: str) -> Path:
        target = self.directory / "artifacts" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def save(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "record.json").write_text(json.dumps(self.record, indent=2, default=str) + "\n")


@contextlib.contextmanager
def job_run(cfg: DictConfig, name: str, tags: dict[str, str] | None = None) -> Iterator[MLflowRecorder | JsonRecorder]:
    """The tracked run of one job; open it at the job's start so its start/end times (and system metrics) cover the
    job. Ends FINISHED, or FAILED (KILLED on Ctrl-C) with the exception in the `error` tag, re-raised."""
    tags = environment_tags() | (tags or {})
    recorder = (JsonRecorder if cfg.tracking.backend == "json" else MLflowRecorder)(cfg, name, tags)
    try:
        yield recorder
    except BaseException as error:
        recorder.close("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED", error)
        raise
    recorder.close("FINISHED")


class MLflowParentRun(Callback):
    """Hydra callback: a multirun opens one parent run; every job's run becomes its child (MLflow backend)."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if config.tracking.backend != "mlflow":
            return
        import mlflow

        configure(config.tracking.uri, config.tracking.experiment, config.tracking.artifacts)
        mlflow.start_run(run_name=f"sweep:{config.tracking.experiment}")
        mlflow.set_tag("sweep_overrides", " ".join(config.hydra.overrides.task))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if config.tracking.backend != "mlflow":
            return
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.end_run()


def main() -> None:
    tracking = OmegaConf.load(ROOT / "conf/tracking/mlflow.yaml")
    parser = argparse.ArgumentParser(description="JSON tracking records ⇄ the MLflow store")
    commands = parser.add_subparsers(dest="command", required=True)
    replay = commands.add_parser("import", help="replay the records under DIR (e.g. from the GPU machine) as runs")
    replay.add_argument("directory")
    replay.add_argument("--artifacts", default=tracking.artifacts)
    export = commands.add_parser("export", help="write EXPERIMENT's runs as records under DIR (e.g. results/NAME)")
    export.add_argument("experiment")
    export.add_argument("directory")
    for command in (replay, export):
        command.add_argument("--uri", default=tracking.uri)
    packing = commands.add_parser("pack", help="store the items of the records under DIR gzipped (items.json.gz)")
    packing.add_argument("directories", nargs="+", metavar="DIR")
    digest = commands.add_parser("digest", help="the code digest of this tree, or of a commit (match a record's tag)")
    digest.add_argument("--rev", help="a git revision (default: the working tree)")
    args = parser.parse_args()
    if args.command == "digest":
        try:
            print(digest_at(args.rev) if args.rev else code_digest())
        except ValueError as error:
            sys.exit(f"digest: {error}")
    elif args.command == "pack":
        try:
            written = pack(args.directories)
        except ValueError as error:  # a folder that is not one; a gzip that does not give back the bytes
            sys.exit(f"pack: {error}")
        size = sum(path.stat().st_size for path in written)
        print(f"packed {len(written)} items artifact(s) into items.json.gz ({size / 2**20:.1f} MiB)")
    elif args.command == "import":
        try:
            found = len(list(Path(args.directory).glob("**/record.json")))
            imported = import_records(args.directory, args.uri, args.artifacts)
            print(f"imported {imported} run(s) into {args.uri} ({found - imported} of {found} were there already)")
        except RecordError as error:
            sys.exit(f"import: {error}")
    else:
        print(f"exported {export_records(args.experiment, args.directory, args.uri)} run(s) to {args.directory}")


if __name__ == "__main__":
    main()
