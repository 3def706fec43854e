"""MLflow tracking: one run per job (a child of the multirun's parent run), params = flattened config,
tags = everything needed to reproduce (fingerprints, git commit, library/CUDA/driver/GPU versions).

The tracking store is sqlite (`sqlite:///mlruns/mlflow.db`); MLflow ≥ 3.13 refuses the plain file store.
"""

from __future__ import annotations

import contextlib
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path

import mlflow
import torch
import transformers
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def configure(uri: str, experiment: str, artifacts: str) -> None:
    """Point MLflow at the sqlite store and create the experiment with artifacts under `artifacts`."""
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


@contextlib.contextmanager
def job_run(cfg: DictConfig, name: str, tags: dict[str, str]) -> Iterator[mlflow.ActiveRun]:
    """An MLflow run for one job: nested under the active (parent) run when there is one."""
    configure(cfg.tracking.uri, cfg.tracking.experiment, cfg.tracking.artifacts)
    with mlflow.start_run(run_name=name, nested=mlflow.active_run() is not None) as run:
        mlflow.log_params(flatten(cfg))
        mlflow.set_tags(environment_tags() | tags)
        mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        yield run


class MLflowParentRun(Callback):
    """Hydra callback: a multirun opens one parent run; every job's run becomes its child."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        configure(config.tracking.uri, config.tracking.experiment, config.tracking.artifacts)
        mlflow.start_run(run_name=f"sweep:{config.tracking.experiment}")
        mlflow.set_tag("sweep_overrides", " ".join(config.hydra.overrides.task))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if mlflow.active_run() is not None:
            mlflow.end_run()
