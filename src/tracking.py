"""Tracking: one run per job (a child of the multirun's parent run), params = flattened config,
tags = everything needed to reproduce (fingerprints, git commit, library/CUDA/driver/GPU versions).

Backend `mlflow` writes to the sqlite store (`sqlite:///mlruns/mlflow.db`; MLflow ≥ 3.13 refuses the
plain file store). Backend `json` writes the same record as files (for the GPU machine, which has no
MLflow); `python -m src.tracking import DIR` replays such records into the MLflow store here.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import platform
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def configure(uri: str, experiment: str, artifacts: str) -> None:
    """Point MLflow at the sqlite store and create the experiment with artifacts under `artifacts`."""
    import mlflow

    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        mlflow.create_experiment(experiment, artifact_location=Path(artifacts).resolve().as_uri())
    mlflow.set_experiment(experiment)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment_tags() -> dict[str, str]:
    """Versions and hardware of this process: git, Python, torch, transformers, CUDA, driver, GPU."""
    tags = {
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": str(bool(_git("status", "--porcelain", "--untracked-files=no"))),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": str(torch.version.cuda),
        "host": platform.machine(),
    }
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


class MLflowRecorder:
    """What a job logs, sent to the active MLflow run."""

    def __init__(self):
        import mlflow

        self.mlflow = mlflow

    def metrics(self, values: dict[str, float], step: int | None = None) -> None:
        self.mlflow.log_metrics(values, step=step)

    def dict(self, value: dict, path: str) -> None:
        self.mlflow.log_dict(value, path)

    def figure(self, figure, path: str) -> None:
        self.mlflow.log_figure(figure, path)


class JsonRecorder:
    """What a job logs, kept as record.json + artifact files in one folder (replayed by `import`)."""

    def __init__(self, directory: Path, record: dict):
        self.directory, self.record = directory, record

    def metrics(self, values: dict[str, float], step: int | None = None) -> None:
        self.record["metrics"] += [{"key": k, "value": float(v), "step": step} for k, v in values.items()]
        self.save()

    def dict(self, value: dict, path: str) -> None:
        self._artifact(path).write_text(json.dumps(value, indent=2, default=str))

    def figure(self, figure, path: str) -> None:
        figure.savefig(self._artifact(path), dpi=120)

    def _artifact(self, path: str) -> Path:
        target = self.directory / "artifacts" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def save(self) -> None:
        (self.directory / "record.json").write_text(json.dumps(self.record, indent=2, default=str))


@contextlib.contextmanager
def job_run(cfg: DictConfig, name: str, tags: dict[str, str]) -> Iterator[MLflowRecorder | JsonRecorder]:
    """A tracked run for one job; with MLflow it nests under the active (parent) run when there is one."""
    tags = environment_tags() | tags
    if cfg.tracking.backend == "json":
        params = flatten(cfg)
        digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]
        directory = Path(cfg.tracking.json_dir) / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}-{digest}"
        directory.mkdir(parents=True, exist_ok=True)
        record = {
            "name": name,
            "experiment": cfg.tracking.experiment,
            "params": params,
            "tags": tags,
            "metrics": [],
        }
        recorder = JsonRecorder(directory, record)
        recorder._artifact("config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        recorder.save()
        yield recorder
        return
    import mlflow

    configure(cfg.tracking.uri, cfg.tracking.experiment, cfg.tracking.artifacts)
    with mlflow.start_run(run_name=name, nested=mlflow.active_run() is not None):
        mlflow.log_params(flatten(cfg))
        mlflow.set_tags(tags)
        mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        yield MLflowRecorder()


def import_records(directory: str | Path, uri: str, artifacts: str) -> int:
    """Replay every JSON record under `directory` as an MLflow run; returns how many."""
    import mlflow

    records = sorted(Path(directory).glob("**/record.json"))
    for path in records:
        record = json.loads(path.read_text())
        configure(uri, record["experiment"], artifacts)
        with mlflow.start_run(run_name=record["name"]):
            mlflow.log_params(record["params"])
            mlflow.set_tags(record["tags"] | {"imported_from": str(path.parent)})
            for metric in record["metrics"]:
                mlflow.log_metric(metric["key"], metric["value"], step=metric["step"] or 0)
            for file in sorted((path.parent / "artifacts").glob("**/*")):
                if file.is_file():
                    relative = file.parent.relative_to(path.parent / "artifacts")
                    mlflow.log_artifact(str(file), None if str(relative) == "." else str(relative))
    return len(records)


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
    tracking = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf/tracking/mlflow.yaml")
    parser = argparse.ArgumentParser(description="replay JSON tracking records (from the GPU machine) into MLflow")
    parser.add_argument("command", choices=["import"])
    parser.add_argument("directory")
    parser.add_argument("--uri", default=tracking.uri)
    parser.add_argument("--artifacts", default=tracking.artifacts)
    args = parser.parse_args()
    print(f"imported {import_records(args.directory, args.uri, args.artifacts)} run(s) into {args.uri}")


if __name__ == "__main__":
    main()
