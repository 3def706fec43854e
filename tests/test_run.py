"""The experiment layer end to end on the tiny random pair: fit_eval (params, metrics, tags, artifacts in MLflow),
the trace and mapper caches, the latency and construction jobs, Optuna (resumable, child runs), and real
`python -m src.run` processes (a run and a multirun with its parent run). All state lives under tmp dirs."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

import src.bench
import src.pipeline
import src.run
from src.gate import check
from src.models import fingerprint
from src.sweep import _coefficients, optimize
from src.traces import load_traces
from src.tracking import flatten

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared/data"
if not (DATA / "corpora").is_dir():
    pytest.skip(f"shared data not found at {DATA}", allow_module_level=True)

TINY = [
    f"paths.data={DATA}",
    "budget.sequences=8",
    "budget.seq_len=64",
    "budget.batch_size=8",
    "eval.nll.streams=2",
    "eval.nll.prefix_len=32",
    "eval.nll.horizon=8",
    "eval.latency.prefix_len=32",
    "eval.latency.repeats=2",
    "eval.latency.warmup=1",
    "fit.k=2",
]
FIT_EVAL_METRICS = {
    "r2_k_heldout",
    "r2_v_heldout",
    "nll_native_source",
    "nll_native_target",
    "nll_transfer",
    "nll_gap_recovered",
    "apply_ms_p50",
    "apply_ms_p95",
    "prefill_ms_p50",
    "prefill_ms_p95",
    "handoff_speedup",
    "rollback_verified",
    "coefficient_count",
    "artifact_bytes",
    "construction_seconds",
    "calibration_rows",
    "trace_seconds",
}
FIT_EVAL_TAGS = {
    "weights",
    "job",
    "direction",
    "pair",
    "method",
    "source_fingerprint",
    "target_fingerprint",
    "tokenizer_hash",
    "corpus_hash",
    "git_commit",
    "python",
    "torch",
    "transformers",
}


class Forbidden(AssertionError):
    pass


def forbid(name: str):
    def refuse(*args, **kwargs):
        raise Forbidden(f"{name} was called: the cache should have been used")

    return refuse


def counting(function, calls: list):
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        calls.append(result)
        return result

    return wrapper


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("kvrelay")
    return SimpleNamespace(
        root=root,
        home=root / "home",
        uri=f"sqlite:///{root / 'mlflow.db'}",
        artifacts=root / "artifacts",
        storage=f"sqlite:///{root / 'optuna.db'}",
    )


def store_overrides(ws, home: Path | None = None, uri: str | None = None) -> list[str]:
    return [
        f"tracking.uri={uri or ws.uri}",
        f"tracking.artifacts={ws.artifacts}",
        f"sweep.storage={ws.storage}",
        *([f"paths.home={home or ws.home}"] if home is not False else []),
    ]


def config(ws, *overrides: str, home: Path | None = None):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("run", overrides=[*store_overrides(ws, home), *TINY, *overrides])


def runs(uri: str, experiment: str, filter_string: str = "") -> list:
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} at {uri}"
    return client.search_runs([found.experiment_id], filter_string, order_by=["attributes.start_time ASC"])


def artifact_paths(uri: str, run_id: str, path: str | None = None) -> set[str]:
    client, found = MlflowClient(uri), set()
    for item in client.list_artifacts(run_id, path):
        found |= artifact_paths(uri, run_id, item.path) if item.is_dir else {item.path}
    return found


def home_files(home: Path) -> dict[str, int]:
    return {str(p.relative_to(home)): p.stat().st_mtime_ns for p in sorted(home.rglob("*")) if p.is_file()}


def command_env(ws) -> dict[str, str]:
    env = dict(os.environ, KVRELAY_HOME=str(ws.home))
    env.pop("KVRELAY_DATA", None)
    return env


# --- fit_eval, in-process -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def first(ws) -> SimpleNamespace:
    """The quickstart fit_eval on an empty home: collects traces once, fits once, logs one MLflow run."""
    cfg = config(ws, "+experiment=quickstart")
    collected, fitted = [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(src.pipeline, "collect_traces", counting(src.pipeline.collect_traces, collected))
        patch.setattr(src.pipeline, "fit_transfer", counting(src.pipeline.fit_transfer, fitted))
        value = src.run.fit_eval(cfg)
    (run,) = runs(ws.uri, "quickstart")
    return SimpleNamespace(cfg=cfg, value=value, run=run, collected=collected, fitted=fitted, files=home_files(ws.home))


def test_fit_eval_logs_the_flattened_config(first, ws):
    params = first.run.data.params
    assert params == flatten(first.cfg)
    assert params["fit.k"] == "2"
    assert params["budget.sequences"] == "8"
    assert (params["support.kind"], params["weighting.kind"], params["pair.name"]) == (
        "local",
        "attn_repair",
        "tiny_qwen3_random",
    )
    assert params["paths.home"] == str(ws.home)
    assert params["tracking.experiment"] == "quickstart"
    assert not any(key.startswith("hydra") for key in params)


def test_fit_eval_metrics(first):
    metrics = first.run.data.metrics
    assert FIT_EVAL_METRICS <= set(metrics), FIT_EVAL_METRICS - set(metrics)
    assert all(math.isfinite(metrics[name]) for name in FIT_EVAL_METRICS)
    assert metrics["rollback_verified"] == 1.0
    assert all(metrics[f"rollback_{case}"] == 1.0 for case in ("nan", "missing_layer", "dtype", "clean_transfers"))
    assert first.value == pytest.approx(metrics["valid.nll_gap_recovered"])  # what sweeps optimize
    assert metrics["handoff_speedup"] == pytest.approx(metrics["prefill_ms_p50"] / metrics["apply_ms_p50"])
    assert 0 < metrics["apply_ms_p50"] <= metrics["apply_ms_p95"]
    assert 0 < metrics["prefill_ms_p50"] <= metrics["prefill_ms_p95"]
    assert min(metrics[f"nll_{m}"] for m in ("native_source", "native_target", "transfer")) > 0
    assert metrics["coefficient_count"] == _coefficients(first.cfg, 2) > 0  # the sweep's storage budget agrees
    assert metrics["artifact_bytes"] >= 4 * metrics["coefficient_count"]  # float32 coefficients
    assert metrics["construction_seconds"] > 0 and metrics["trace_seconds"] > 0
    (traces,) = (Path(first.cfg.paths.home) / "traces").glob("*.json")
    all_rows = load_traces(traces.with_suffix("")).rows
    assert all_rows == 8 * 64 // 4
    assert metrics["calibration_rows"] + metrics["heldout_rows"] == all_rows and metrics["heldout_rows"] > 0


def test_fit_eval_tags(first):
    tags = first.run.data.tags
    assert FIT_EVAL_TAGS <= set(tags), FIT_EVAL_TAGS - set(tags)
    assert (tags["weights"], tags["job"], tags["direction"]) == ("random", "fit_eval", "tiny_small_to_large")
    assert tags["method"] == "local+attn_repair"
    assert "random weights" in tags["note"]
    pair = src.pipeline.load(first.cfg)
    assert tags["source_fingerprint"] == fingerprint(pair.source) != tags["target_fingerprint"]
    assert tags["target_fingerprint"] == fingerprint(pair.target)
    assert tags["torch"] == torch.__version__ and tags["transformers"] == transformers.__version__
    assert tags["git_commit"] != ""
    assert first.run.info.status == "FINISHED"
    assert first.run.info.run_name == "tiny_qwen3_random:local+attn_repair:k2"
    assert "mlflow.parentRunId" not in tags


def test_fit_eval_artifacts(first, ws, tmp_path):
    run_id = first.run.info.run_id
    assert {"config.yaml", "mapper/manifest.json", "plots/r2_by_layer.png"} <= artifact_paths(ws.uri, run_id)
    assert first.run.info.artifact_uri.startswith(ws.artifacts.resolve().as_uri())
    client = MlflowClient(ws.uri)
    logged = OmegaConf.load(client.download_artifacts(run_id, "config.yaml", str(tmp_path)))
    assert logged.fit.k == 2 and logged.paths.home == str(ws.home)
    assert "${" not in (tmp_path / "config.yaml").read_text()  # resolved
    manifest = json.loads(Path(client.download_artifacts(run_id, "mapper/manifest.json", str(tmp_path))).read_text())
    assert manifest["weights"] == "random"
    assert manifest["coefficient_count"] == first.run.data.metrics["coefficient_count"]
    assert manifest["source_fingerprint"] == first.run.data.tags["source_fingerprint"]
    assert manifest["config"]["fit"]["k"] == 2 and manifest["config"]["paths"]["home"] == str(ws.home)
    png = Path(client.download_artifacts(run_id, "plots/r2_by_layer.png", str(tmp_path))).read_bytes()
    assert png.startswith(b"\x89PNG")


def test_first_run_fills_the_caches(first, ws):
    assert (len(first.collected), len(first.fitted)) == (1, 1)
    traces = [f for f in first.files if f.startswith("traces/")]
    assert sorted(Path(f).suffix for f in traces) == [".json", ".safetensors"]
    mappers = {f.split("/")[1] for f in first.files if f.startswith("mappers/") and f.endswith("manifest.json")}
    assert len(mappers) == 1  # one artifact (its versioned directories live inside it)
    assert set(Path(f).parts[0] for f in first.files) == {"traces", "mappers"}


def test_identical_run_reuses_traces_and_mapper(first, ws, monkeypatch):
    monkeypatch.setattr(src.pipeline, "collect_traces", forbid("collect_traces"))
    monkeypatch.setattr(src.pipeline, "fit_transfer", forbid("fit_transfer"))
    value = src.run.fit_eval(config(ws, "+experiment=quickstart"))
    before, after = runs(ws.uri, "quickstart")
    assert before.info.run_id == first.run.info.run_id
    for name in ("construction_seconds", "trace_seconds", "calibration_rows", "r2_k_heldout", "r2_v_heldout"):
        assert after.data.metrics[name] == before.data.metrics[name], name
    assert value == pytest.approx(first.value)  # same mapper, same streams
    now = home_files(ws.home)
    assert {path: now[path] for path in first.files} == first.files  # nothing rewritten


def test_changed_fit_refits_on_cached_traces(first, ws, monkeypatch):
    fitted = []
    monkeypatch.setattr(src.pipeline, "collect_traces", forbid("collect_traces"))
    monkeypatch.setattr(src.pipeline, "fit_transfer", counting(src.pipeline.fit_transfer, fitted))
    src.run.fit_eval(config(ws, "+experiment=quickstart", "fit.k=1"))
    assert len(fitted) == 1
    run = runs(ws.uri, "quickstart", "params.`fit.k` = '1'")[-1]
    assert run.data.metrics["coefficient_count"] == first.run.data.metrics["coefficient_count"] / 2
    mappers = {p.parent for p in (ws.home / "mappers").glob("*/manifest.json")}
    assert len(mappers) == 2


def test_stale_cached_mapper_is_refit(first, ws, tmp_path, monkeypatch):
    home = tmp_path / "home"
    shutil.copytree(ws.home, home)
    (manifest_path,) = [
        p for p in home.glob("mappers/*/manifest.json") if json.loads(p.read_text())["config"]["fit"]["k"] == 2
    ]
    manifest = json.loads(manifest_path.read_text())
    manifest["source_fingerprint"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    fitted = []
    monkeypatch.setattr(src.pipeline, "collect_traces", forbid("collect_traces"))
    monkeypatch.setattr(src.pipeline, "fit_transfer", counting(src.pipeline.fit_transfer, fitted))
    src.run.fit_eval(config(ws, "+experiment=quickstart", "tracking.experiment=stale", home=home))
    assert len(fitted) == 1
    assert json.loads(manifest_path.read_text())["source_fingerprint"] == first.run.data.tags["source_fingerprint"]


class _Measured(Exception):
    pass


def test_latency_prefix_has_the_configured_length(first, ws, monkeypatch):
    lengths = []

    def measure(transfer, prefix, repeats, warmup, levers):
        lengths.append(prefix.shape[1])
        raise _Measured

    monkeypatch.setattr(src.run, "handoff_latency", measure)
    with pytest.raises(_Measured):
        src.run.fit_eval(config(ws, "+experiment=quickstart", "eval.latency.prefix_len=48"))
    assert lengths == [48]


def test_the_policy_on_the_command_line_reaches_the_offline_splice(first, ws, monkeypatch):
    """`policy.levers.*` (conf/policy/default.yaml) are the levers fit_eval's NLL splices with (and its name says)."""
    from src.runtime.plan import Levers

    seen = []

    def nll(transfer, streams, prefix_len, levers):
        seen.append(levers)
        raise _Measured

    monkeypatch.setattr(src.run, "horizon_nll", nll)
    cfg = config(ws, "+experiment=quickstart", "policy.levers.recompute=0.25", "policy.levers.native_sink=2")
    with pytest.raises(_Measured):
        src.run.fit_eval(cfg)
    assert seen == [Levers(native_sink=2, recompute=0.25)]
    assert src.run.run_name(cfg, "m", seen[0]).endswith(":sink2:hold0:layers0:recompute0.25:deviation")


# --- latency and construction jobs --------------------------------------------------------------------------------


def test_latency_job(first, ws, tmp_path):
    cfg = config(ws, "+experiment=latency", "eval.latency.prefix_lens=[16,32]")
    assert src.bench.latency(cfg) is None
    (run,) = runs(ws.uri, "latency")
    metrics, client = run.data.metrics, MlflowClient(ws.uri)
    for kind in ("full", "local"):
        for name in ("apply_ms_p50", "apply_ms_p95", "prefill_ms_p50", "handoff_speedup"):
            assert f"{name}.{kind}" in metrics
            assert [m.step for m in client.get_metric_history(run.info.run_id, f"{name}.{kind}")] == [16, 32]
    assert (run.data.tags["job"], run.data.tags["weights"]) == ("latency", "random")
    assert {"config.yaml", "latency.json", "plots/latency_vs_prefix.png"} <= artifact_paths(ws.uri, run.info.run_id)
    logged = json.loads(Path(client.download_artifacts(run.info.run_id, "latency.json", str(tmp_path))).read_text())
    assert set(logged) == {"storage", "latency"} and set(logged["storage"]) == {"full", "local"}
    assert set(logged["latency"]["full"]) == {"16", "32"} and logged["latency"]["full"]["32"]["apply_ms_p50"] > 0
    assert logged["storage"]["full"]["artifact_bytes"] > logged["storage"]["local"]["artifact_bytes"]


def test_probe_job(first, ws):
    value = src.run.main.__wrapped__(config(ws, "+experiment=feature_probe", "eval.probe.relu_width=32"))
    (run,) = runs(ws.uri, "feature_probe")
    metrics = run.data.metrics
    for variant in ("own", "kv", "token", "relu"):
        for component in "kv":
            assert {f"{variant}.r2_{component}_fit", f"{variant}.r2_{component}_heldout"} <= set(metrics)
    assert metrics["relu.width_v"] == metrics["own.width_v"] + 32
    assert value == pytest.approx(metrics["relu.r2_v_heldout"])
    assert run.data.tags["job"] == "probe" and run.data.tags["weights"] == "random"
    assert "probe/scores.json" in artifact_paths(ws.uri, run.info.run_id)


@pytest.mark.parametrize(("budgets", "steps"), [("[4,8,50]", [4, 8]), ("[50,100]", [8])])
def test_construction_job(first, ws, monkeypatch, budgets, steps):
    fitted = []
    monkeypatch.setattr(src.bench, "fit_mapper", counting(src.bench.fit_mapper, fitted))
    experiment = f"construction_{len(steps)}"
    cfg = config(
        ws,
        "+experiment=construction",
        "eval.construction.repeats=1",
        f"eval.construction.budgets={budgets}",
        f"tracking.experiment={experiment}",
    )
    assert src.bench.construction(cfg) is None
    (run,) = runs(ws.uri, experiment)
    client = MlflowClient(ws.uri)
    for name in ("generic_seconds", "streaming_seconds", "max_relative_difference"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == steps, name
    history = client.get_metric_history(run.info.run_id, "max_relative_difference")
    assert all(0 <= m.value <= 1e-6 for m in history)
    assert run.data.tags["job"] == "construction"
    assert "plots/construction_vs_budget.png" in artifact_paths(ws.uri, run.info.run_id)
    assert len(fitted) == 3 * len(steps)  # generic, streaming, fused (fit.statistics under +experiment=construction)
    for generic, *others in zip(fitted[::3], fitted[1::3], fitted[2::3], strict=True):  # every coefficient
        for other in others:
            for name, tensor in generic.tensors().items():
                scale = tensor.abs().max().clamp_min(1e-12)
                assert float((tensor - other.tensors()[name]).abs().max() / scale) <= 1e-6, name


# --- Optuna -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def study(first, ws) -> SimpleNamespace:
    """3 trials, then the same study resumed for 1 more; traces come from the cache throughout."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(src.pipeline, "collect_traces", forbid("collect_traces"))
        cfg = config(ws, "+experiment=optuna", "sweep.n_trials=3")
        best = optimize(cfg, src.run.fit_eval)
        after_three = optuna.load_study(study_name=cfg.sweep.study_name, storage=ws.storage).trials
        best_again = optimize(config(ws, "+experiment=optuna", "sweep.n_trials=1"), src.run.fit_eval)
    trials = optuna.load_study(study_name=cfg.sweep.study_name, storage=ws.storage).trials
    return SimpleNamespace(cfg=cfg, best=best, best_again=best_again, after_three=after_three, trials=trials)


def test_optuna_study_runs_and_resumes(study):
    assert len(study.after_three) == 3 and len(study.trials) == 4
    assert [t.number for t in study.trials] == [0, 1, 2, 3]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert study.best == max(t.value for t in study.after_three)
    assert study.best_again == max(t.value for t in study.trials)
    assert all(1 <= t.params["k"] <= 4 for t in study.trials)  # capped at the tiny source's 4 layers
    assert all(study.cfg.sweep.lam.low <= t.params["lam"] <= study.cfg.sweep.lam.high for t in study.trials)


def test_optuna_trials_are_mlflow_child_runs(study, ws):
    parents = runs(ws.uri, "optuna_k_lambda", "tags.job = 'optuna'")
    assert len(parents) == 2
    assert all(p.info.run_name == "optuna:k_lambda" and p.info.status == "FINISHED" for p in parents)
    children = [runs(ws.uri, "optuna_k_lambda", f"tags.mlflow.parentRunId = '{p.info.run_id}'") for p in parents]
    assert [len(c) for c in children] == [3, 1]
    for run, trial in zip(children[0] + children[1], study.trials, strict=True):
        assert run.data.tags["job"] == "fit_eval"
        assert run.data.params["fit.k"] == str(trial.params["k"])
        assert float(run.data.params["fit.lam"]) == pytest.approx(trial.params["lam"])
        assert run.data.metrics["valid.nll_gap_recovered"] == pytest.approx(trial.value)
    first_parent = parents[0]
    assert first_parent.data.params["best_k"] == str(max(study.after_three, key=lambda t: t.value).params["k"])
    assert first_parent.data.metrics["best_valid.nll_gap_recovered"] == pytest.approx(study.best)


def test_resumed_study_explores_new_points(study):
    seen = [(t.params["k"], t.params["lam"]) for t in study.after_three]
    assert (study.trials[3].params["k"], study.trials[3].params["lam"]) not in seen


def test_optuna_prunes_trials_over_the_storage_budget(first, ws):
    cfg = config(
        ws,
        "+experiment=optuna",
        "sweep.n_trials=8",
        "sweep.study_name=pruning",
        f"sweep.max_coefficients={_coefficients(config(ws), 2)}",
        "tracking.experiment=optuna_pruning",
    )
    seen = []
    optimize(cfg, lambda trial_cfg: seen.append(trial_cfg.fit.k) or float(trial_cfg.fit.k))
    trials = optuna.load_study(study_name="pruning", storage=ws.storage).trials
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    assert len(trials) == 8 and pruned and seen
    assert all(t.params["k"] > 2 for t in pruned) and all(k <= 2 for k in seen)


def test_optuna_with_every_trial_pruned_reports_no_best(first, ws):
    cfg = config(
        ws,
        "+experiment=optuna",
        "sweep.n_trials=2",
        "sweep.study_name=all_pruned",
        "sweep.max_coefficients=1",
        "tracking.experiment=optuna_all_pruned",
    )
    assert math.isnan(optimize(cfg, lambda trial_cfg: 0.0))


def test_optuna_sweeps_the_attn_repair_alpha_cap_when_asked(first, ws):
    overrides = ("+experiment=optuna", "sweep.n_trials=3", "sweep.alpha_cap={low: 0.2, high: 0.9}")
    cfg = config(ws, *overrides, "weighting=attn_repair", "sweep.study_name=alpha", "tracking.experiment=optuna_alpha")
    seen = []
    optimize(cfg, lambda trial_cfg: seen.append(trial_cfg.weighting.alpha_cap) or trial_cfg.weighting.alpha_cap)
    trials = optuna.load_study(study_name="alpha", storage=ws.storage).trials
    assert [t.params["alpha_cap"] for t in trials] == seen and all(0.2 <= a <= 0.9 for a in seen)
    uniform = config(ws, *overrides, "sweep.study_name=alpha_uniform", "tracking.experiment=optuna_alpha")
    with pytest.raises(ValueError, match="alpha_cap needs weighting=attn_repair"):
        optimize(uniform, lambda trial_cfg: 0.0)


# --- real processes -----------------------------------------------------------------------------------------------


def test_quickstart_process(first, ws):
    """`python -m src.run +experiment=quickstart` in a fresh process, home from KVRELAY_HOME: reuses the caches."""
    uri = f"sqlite:///{ws.root / 'process.db'}"
    traces_before = sorted(p.name for p in (ws.home / "traces").iterdir())
    command = [sys.executable, "-m", "src.run", "+experiment=quickstart", *store_overrides(ws, home=False, uri=uri)]
    command += [*TINY, f"hydra.run.dir={ws.root / 'outputs'}"]
    done = subprocess.run(command, cwd=REPO, env=command_env(ws), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "weights=random" in done.stdout
    (run,) = runs(uri, "quickstart")
    assert run.data.params["paths.home"] == str(ws.home)
    assert run.data.params["paths.data"] == str(DATA)
    assert FIT_EVAL_METRICS <= set(run.data.metrics) and run.data.metrics["rollback_verified"] == 1.0
    assert FIT_EVAL_TAGS <= set(run.data.tags) and run.data.tags["weights"] == "random"
    for name in ("source_fingerprint", "target_fingerprint", "corpus_hash"):
        assert run.data.tags[name] == first.run.data.tags[name], name  # stable across processes
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:
        assert run.data.tags["git_commit"] == head.stdout.strip()
    for name in ("construction_seconds", "trace_seconds"):
        assert run.data.metrics[name] == first.run.data.metrics[name], f"{name}: cache not reused across processes"
    assert sorted(p.name for p in (ws.home / "traces").iterdir()) == traces_before
    assert (ws.root / "outputs/.hydra/config.yaml").is_file()
    assert {"config.yaml", "mapper/manifest.json", "plots/r2_by_layer.png"} <= artifact_paths(uri, run.info.run_id)


def test_a_sweep_reports_a_failed_job_when_it_fails(tmp_path):
    """Hydra's launcher raises a failed job's error only once every job of the sweep ended: a sweep cut by a deadline
    (a device call's budget) then reports none, and a job that failed before its record opened leaves no trace. Each
    failed job is said on stderr as it fails, before the next job starts (here: no weights under paths.home)."""
    command = [sys.executable, "-m", "src.run", "-m", "+experiment=quickstart", "pair=qwen25coder_0p5b_to_1p5b",
               "seed=1,2", f"paths.home={tmp_path / 'home'}", f"paths.data={DATA}", "tracking.backend=json",
               f"tracking.json_dir={tmp_path / 'trk'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    first, second = (done.stderr.find(f"job failed (+experiment=quickstart pair=qwen25coder_0p5b_to_1p5b seed={n} ")
                     for n in (1, 2))  # fmt: skip
    deferred = done.stderr.find("Error executing job")  # the launcher's own report, after every job
    assert 0 <= first < second < deferred
    assert "FileNotFoundError: no model at" in done.stderr[first:second]


def test_multirun_process_has_one_parent_and_two_children(first, ws):
    uri = f"sqlite:///{ws.root / 'multirun.db'}"
    command = [sys.executable, "-m", "src.run", "-m", "+experiment=quickstart", "support=full,local"]
    command += [*store_overrides(ws, home=False, uri=uri), *TINY, f"hydra.sweep.dir={ws.root / 'multirun'}"]
    done = subprocess.run(command, cwd=REPO, env=command_env(ws), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    everything = runs(uri, "quickstart")
    parents = [r for r in everything if "mlflow.parentRunId" not in r.data.tags]
    assert len(everything) == 3 and len(parents) == 1
    (parent,) = parents
    assert parent.info.run_name == "sweep:quickstart" and parent.info.status == "FINISHED"
    assert "support=full,local" in parent.data.tags["sweep_overrides"]
    children = runs(uri, "quickstart", f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 2
    assert {c.data.params["support.kind"] for c in children} == {"full", "local"}
    assert all(c.data.tags["job"] == "fit_eval" and c.info.status == "FINISHED" for c in children)
    assert {c.data.tags["method"] for c in children} == {"full+attn_repair", "local+attn_repair"}
    assert all((ws.root / "multirun" / str(n) / ".hydra").is_dir() for n in (0, 1))
    assert check(uri, "quickstart", parent.info.run_id, 2.0, 1.0) == 1  # random weights never pass the gate
