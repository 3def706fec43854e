"""The Optuna study tunes on validation metrics only (src/sweep.py): a test-metric objective is refused before the
study opens; a `valid.` one runs (a stand-in job, no models, no MLflow: test_run.py runs the real study)."""

from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from hydra import compose, initialize_config_dir

import src.sweep
from src.sweep import VALIDATION, check_objective, optimize

CONF = Path(__file__).resolve().parents[1] / "conf"


def composed(tmp_path: Path, *overrides: str):
    stores = [
        f"sweep.storage=sqlite:///{tmp_path / 'optuna.db'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"tracking.artifacts={tmp_path / 'artifacts'}",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("run", overrides=["+experiment=optuna", *stores, *overrides])


@pytest.mark.parametrize("objective", ["nll_gap_recovered", "task.mean.acc", "nll_transfer", "validation.acc"])
def test_a_sweep_refuses_to_tune_on_test_metrics(tmp_path, objective):
    cfg = composed(tmp_path, f"objective={objective}")
    job = lambda _: pytest.fail("no trial may run on a test-metric objective")
    with pytest.raises(ValueError, match="not a validation metric"):
        optimize(cfg, job)
    assert not (tmp_path / "optuna.db").exists() and not (tmp_path / "mlflow.db").exists()  # refused up front


def test_a_sweep_tunes_on_a_validation_metric(tmp_path, monkeypatch):
    ignore = lambda *_, **__: None
    monkeypatch.setattr(src.sweep.mlflow_store, "configure", ignore)
    stub = dict(start_run=lambda **_: nullcontext(), active_run=ignore, set_tags=ignore, log_params=ignore)
    monkeypatch.setattr(src.sweep, "mlflow", SimpleNamespace(**stub, log_metric=ignore))
    cfg = composed(tmp_path, f"objective={VALIDATION}nll_gap_recovered", "sweep.n_trials=2")
    seen = []
    best = optimize(cfg, lambda trial_cfg: seen.append(trial_cfg.fit.k) or -float(trial_cfg.fit.k))
    study = optuna.load_study(study_name=cfg.sweep.study_name, storage=cfg.sweep.storage)
    assert len(seen) == 2 and best == max(-k for k in seen) and len(study.trials) == 2
    check_objective("valid.task.mean.acc")  # any validation metric passes
