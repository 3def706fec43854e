"""Optuna over k, λ and Attn-Repair's α cap, driven directly (PyPI's hydra-optuna-sweeper 1.3.0 pins optuna < 3).

Each trial copies the composed config, sets `fit.k`, `fit.lam` (absolute or relative to the Gram diagonal, as
`fit.lam_relative` says) and, when `sweep.alpha_cap` gives a range, `weighting.alpha_cap`, and runs the same job as
an MLflow child run of one study run. Traces are cached, so trials refit without re-running the
models. The study lives in sqlite (`sweep.storage`) and resumes when started again with the same name.
A study tunes on validation text only: its `objective` must be a `valid.` metric (e.g. `valid.nll_gap_recovered`,
the NLL on `eval.nll.valid_corpus`); test windows and items are only reported, never optimized.
"""

from __future__ import annotations

from collections.abc import Callable

import mlflow
import optuna
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig

from src import mlflow_store
from src.corpus import VALIDATION
from src.support import coefficient_count


def check_objective(objective: str) -> None:
    """Refuse to tune on anything but a validation metric."""
    if not objective.startswith(VALIDATION):
        raise ValueError(
            f"objective {objective!r} is not a validation metric: sweeps tune on `{VALIDATION}*` metrics "
            f"(e.g. objective={VALIDATION}nll_gap_recovered); test windows and items are only reported"
        )


def _coefficients(cfg: DictConfig, k: int) -> int:
    """C(f) (Eqs. 12–13) of the pair's shapes at this k, for the storage budget."""
    source, target = cfg.pair.source.get("config"), cfg.pair.target.get("config")
    if source is None or target is None:
        return 0
    head_dim = lambda c: c.get("head_dim") or c.hidden_size // c.num_attention_heads
    fan_in = source.num_key_value_heads if cfg.support.kind in ("full", "pca") else 1
    return coefficient_count(
        target.num_hidden_layers, target.num_key_value_heads, k, fan_in, head_dim(source), head_dim(target)
    )


def _source_layers(cfg: DictConfig) -> int:
    config = cfg.pair.source.get("config")
    if config is not None:
        return config.num_hidden_layers
    return AutoConfig.from_pretrained(cfg.pair.source.path, local_files_only=True).num_hidden_layers


def optimize(cfg: DictConfig, job: Callable[[DictConfig], float]) -> float:
    """Run (or resume) the study; returns the best objective value."""
    sweep = cfg.sweep
    check_objective(cfg.objective)
    if sweep.get("alpha_cap") is not None and cfg.weighting.kind != "attn_repair":
        raise ValueError("sweep.alpha_cap needs weighting=attn_repair (uniform weighting has no α)")
    mlflow_store.configure(cfg.tracking.uri, cfg.tracking.experiment, cfg.tracking.artifacts)
    study = optuna.create_study(
        study_name=sweep.study_name, storage=sweep.storage, direction=sweep.direction, load_if_exists=True
    )
    study.sampler = optuna.samplers.TPESampler(seed=sweep.seed + len(study.trials))  # a resume explores anew

    def objective(trial: optuna.Trial) -> float:
        k = trial.suggest_int("k", sweep.k.low, min(sweep.k.high, _source_layers(cfg)))
        lam = trial.suggest_float("lam", sweep.lam.low, sweep.lam.high, log=sweep.lam.log)
        if sweep.max_coefficients is not None and _coefficients(cfg, k) > sweep.max_coefficients:
            raise optuna.TrialPruned(f"k={k} exceeds the storage budget of {sweep.max_coefficients} coefficients")
        trial_cfg = OmegaConf.merge(cfg, {"fit": {"k": k, "lam": lam}})
        if sweep.get("alpha_cap") is not None:
            alpha = trial.suggest_float("alpha_cap", sweep.alpha_cap.low, sweep.alpha_cap.high)
            trial_cfg = OmegaConf.merge(trial_cfg, {"weighting": {"alpha_cap": alpha}})
        return job(trial_cfg)

    with mlflow.start_run(run_name=f"optuna:{sweep.study_name}", nested=mlflow.active_run() is not None):
        mlflow.set_tags({"job": "optuna", "study": sweep.study_name, "storage": sweep.storage})
        study.optimize(objective, n_trials=sweep.n_trials)
        if not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
            print(f"no trial of {len(study.trials)} completed (all pruned or failed): no best point")
            return float("nan")
        mlflow.log_params({f"best_{name}": value for name, value in study.best_params.items()})
        mlflow.log_metric(f"best_{cfg.objective}", study.best_value)
    print(f"best of {len(study.trials)} trials: {study.best_params} → {cfg.objective} = {study.best_value:.4f}")
    return study.best_value
