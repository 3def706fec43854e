"""The composed config, checked before a job starts: `check_config(cfg, jobs)` is the first thing `python -m src.run`
does (src/run.py `main`), before any model loads, any trace or mapper is built, and any MLflow run opens. A config
that cannot run is a `ConfigError` — one line that names the key and what is wrong — never a traceback and never a
FAILED run after the models loaded and the mapper was fitted.

It checks what the jobs would refuse later, with the checks they use (called here, not copied):
- the job: one of src/run.py JOBS;
- the policy group (conf/policy/default.yaml): every key a field of `Policy` or, under `levers`, of `Levers` — an
  unknown key is named with the closest valid one — and the values through `policy_from` (Policy's and Levers' own
  checks: the mode, the length guard, the bounds, counts and shares, the recompute rule);
- the levers against the receiver the job splices onto (src/runtime/plan.py `check_splice`, the receiver's capabilities): the routed job's
  static engine when `workload.engine_capacity` is set (the attention rule is not built there), Hugging Face's
  DynamicCache otherwise and in fit_eval (the turn rule and progressive selection need the engine), the deviation
  rule's depth with token features (`fit.token_features`). `check_splice` reads a prefix length and the new turn's
  length; the check takes a long prefix (`LONG_PREFIX`: any recompute share > 0 recomputes a token there) and a
  one-token turn (every job reads at least one), so it refuses what no history of the run could splice;
- the routed workload (src/routed.py `check_workload`): its name, and the engine, shards and read-error diagnosis
  only where it supports them;
- the data: `paths.data` is a folder for the jobs that read corpora or task items (`DATA_JOBS`; the construction job
  on a synthetic budget reads none, the gate reads records).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import fields
from pathlib import Path

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from src.routed import check_workload
from src.routed_workloads import WORKLOADS
from src.runtime.plan import Levers, check_splice
from src.runtime.receivers import CacheReceiver, EngineReceiver
from src.runtime.routing import Policy, policy_from

LONG_PREFIX = 1 << 20  # tokens the lever check assumes (module docstring)
SPLICING_JOBS = ("fit_eval", "optuna", "routed")  # the jobs whose sessions or offline scoring splice with the levers
DATA_JOBS = ("fit_eval", "optuna", "routed", "probe", "latency", "handoff")  # they read paths.data


class ConfigError(ValueError):
    """A composed config that cannot run; the message names the key and what is wrong, in one line."""


def check_config(cfg: DictConfig, jobs: Iterable[str]) -> None:
    """A ConfigError unless the job, its policy and (routed) its workload can run (module docstring)."""
    try:
        _check(cfg, list(jobs))
    except ConfigError:
        raise
    except (ValueError, OmegaConfBaseException) as error:  # a reused check's refusal, a mandatory value left ???
        raise ConfigError(str(error).splitlines()[0]) from None


def _check(cfg: DictConfig, jobs: list[str]) -> None:
    if cfg.job not in jobs:
        raise ConfigError(f"job {cfg.job!r} is not a job{closest(str(cfg.job), jobs)}")
    policy = check_policy(cfg.policy)
    data = Path(str(cfg.paths.data))
    if cfg.job in DATA_JOBS and not data.is_dir():
        raise ConfigError(f"paths.data {str(data)!r} is not a folder (from {Path.cwd()}): the {cfg.job} job reads corpora "
                          "and task items there — put the shared data at ../shared/data beside the clone, or set "
                          "KVRELAY_DATA=/path/to/shared/data")  # fmt: skip
    if cfg.job not in SPLICING_JOBS:
        return
    static, receiver = False, "Hugging Face's DynamicCache (fit_eval scores offline there)"
    if cfg.job == "routed":
        if "workload" not in cfg:
            raise ConfigError(f"the routed job needs a workload: +workload=NAME, one of {sorted(WORKLOADS)}")
        check_workload(cfg)
        if policy.mode == "reprefill":
            return  # the session never splices: the levers are unused
        static = cfg.workload.engine_capacity is not None
        engine = "the static engine (workload.engine_capacity is set)"
        receiver = engine if static else "Hugging Face's DynamicCache (workload.engine_capacity: null)"
    try:
        capabilities = (EngineReceiver if static else CacheReceiver).capabilities
        check_splice(policy.levers, bool(cfg.fit.token_features), LONG_PREFIX, 1, capabilities)
    except ValueError as error:
        raise ConfigError(f"policy.levers on {receiver}: {error}") from None


def check_policy(node: object) -> Policy:
    """The Policy of a `policy:` config node, once every key is a field of Policy or (under `levers`) of Levers; an
    unknown key is a ConfigError naming the closest valid one, a value the Policy refuses a ConfigError naming it."""
    if not isinstance(node, Mapping) or not isinstance(node.get("levers"), Mapping):
        raise ConfigError("policy must be a mapping with a `levers` mapping (conf/policy/default.yaml)")
    for prefix, keys, known in (("policy", node, Policy), ("policy.levers", node["levers"], Levers)):
        names = [field.name for field in fields(known)]
        for key in keys:
            if key not in names:
                raise ConfigError(f"{prefix}.{key} is not a key of the policy{closest(str(key), names, f'{prefix}.')}")
    try:
        return policy_from(node)
    except ValueError as error:
        raise ConfigError(f"policy: {error}") from None


def closest(key: str, valid: Iterable[str], prefix: str = "") -> str:
    """': did you mean PREFIX+NAME?' for the valid name closest to `key`, else ' (valid: …)' listing them all."""
    valid = sorted(valid)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f": did you mean {prefix}{match[0]}?" if match else f" (valid: {', '.join(prefix + v for v in valid)})"
