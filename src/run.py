"""The job: `python -m src.run +experiment=NAME` (Hydra). The only module that reads the whole cfg.

fit_eval: load pair → calibration traces (cached) → select + fit (cached artifact) → verify by
reloading → held-out R², horizon NLL, task accuracy vs both native models, fidelity on task prompts,
native-swap attribution, handoff latency, rollback → MLflow. probe: held-out R² of wider closed-form
maps on the same traces (src/probe.py). Other jobs: latency, construction, gate, optuna. A
multirun in one process loads each pair and each calibration set once (`_MEMO`).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import hydra
import matplotlib
import torch
from omegaconf import DictConfig, OmegaConf

from src import tracking
from src.apply import KVTransfer
from src.artifact import ArtifactError, Mapper, load_mapper, save_mapper
from src.corpus import token_sequences
from src.eval.accuracy import TaskScores, by_length, compare, score_task, summarize
from src.eval.diagnose import cache_fidelity, swap_nll
from src.eval.latency import handoff_latency
from src.eval.metrics import mapper_r2
from src.eval.nll import horizon_nll
from src.eval.rollback import verify_rollback
from src.fit import fit_transfer
from src.handoff import Levers
from src.models import Pair, describe_kv, fingerprint, load_pair
from src.probe import probe_features
from src.select import layers_for_support
from src.support import head_assignment
from src.synthetic import synthetic_mapper, synthetic_traces
from src.tasks import load_task
from src.traces import Traces, collect_traces, corpus_hash, load_traces, save_traces

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SYSTEMS_JOBS = ("latency", "construction", "handoff")  # in src/bench.py
_MEMO: dict[str, object] = {}  # pair / traces / native task scores already built in this process


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def load(cfg: DictConfig) -> Pair:
    spec = lambda node: OmegaConf.to_container(node, resolve=True)
    key = _key("pair", spec(cfg.pair))
    if key not in _MEMO:
        _MEMO.clear()  # one pair (and its traces) resident at a time
        _MEMO[key] = _load_pair(cfg)
    return _MEMO[key]


def _load_pair(cfg: DictConfig) -> Pair:
    spec = lambda node: OmegaConf.to_container(node, resolve=True)
    dtype = getattr(torch, cfg.pair.dtype)
    return load_pair(
        spec(cfg.pair.source),
        spec(cfg.pair.target),
        cfg.pair.weights,
        dtype,
        cfg.pair.device,
        cfg.pair.allow_sliding_window,
        cfg.pair.attn_implementation,
    )


def calibration(cfg: DictConfig, pair: Pair) -> tuple[Traces, str]:
    """Traces for the budget, from the cache keyed by pair fingerprints + corpus hash + budget."""
    budget = cfg.budget
    if budget.synthetic:
        kvs = describe_kv(pair.source), describe_kv(pair.target)
        traces = synthetic_traces(
            *kvs,
            budget.sequences,
            budget.seq_len // budget.stride,
            cfg.pair.device,
            getattr(torch, budget.storage_dtype),
            cfg.seed,
        )
        return traces, f"synthetic-{cfg.seed}"
    vocab = pair.target.config.get_text_config().vocab_size
    ids = token_sequences(cfg.paths.data, budget.corpus, budget.sequences, budget.seq_len, pair.tokenizer, vocab)
    key = _key(fingerprint(pair.source), fingerprint(pair.target), corpus_hash(ids), OmegaConf.to_container(budget))
    if f"traces:{key}" in _MEMO:
        return _MEMO[f"traces:{key}"], key
    path = Path(cfg.paths.home) / "traces" / key
    traces = load_traces(path)
    if traces is None:
        began = time.perf_counter()
        traces = collect_traces(
            pair.source,
            pair.target,
            ids,
            budget.stride,
            budget.batch_size,
            getattr(torch, budget.storage_dtype),
            budget.attention_boundaries,
            budget.first_boundary,
        )
        traces.meta["collect_seconds"] = time.perf_counter() - began
        save_traces(traces, path)
    traces = traces.to(cfg.pair.device)  # statistics are built where the models run
    _MEMO[f"traces:{key}"] = traces
    return traces, key


def split_rows(cfg: DictConfig, traces: Traces) -> tuple[Traces, Traces]:
    """Fit rows and held-out rows; with `fit.sequences` (the budget lever) only the first N fit sequences."""
    fit_rows, heldout = traces.split_heldout(cfg.budget.heldout_fraction)
    if cfg.fit.sequences is not None:
        fit_rows = fit_rows.select_rows(torch.nonzero(fit_rows.sequence_index < cfg.fit.sequences)[:, 0])
    return fit_rows, heldout


def build_mapper(cfg: DictConfig, pair: Pair, traces: Traces, traces_key: str, support: DictConfig) -> Mapper:
    """Fit on the non-held-out rows (or reuse the verified cached artifact for the same inputs)."""
    fit = cfg.fit
    if cfg.budget.synthetic:
        identity = {
            "source_fingerprint": fingerprint(pair.source),
            "target_fingerprint": fingerprint(pair.target),
            "tokenizer_hash": pair.tokenizer_hash,
            "weights": pair.weights,
        }
        return synthetic_mapper(
            describe_kv(pair.source), describe_kv(pair.target), support.kind, fit.k, identity, cfg.seed
        )
    key = _key(
        traces_key,
        cfg.budget.heldout_fraction,
        OmegaConf.to_container(fit),
        OmegaConf.to_container(support),
        OmegaConf.to_container(cfg.weighting),
    )
    directory = Path(cfg.paths.home) / "mappers" / key
    if (directory / "manifest.json").is_file():
        try:
            return load_mapper(directory, fingerprint(pair.source), fingerprint(pair.target), pair.tokenizer_hash)
        except ArtifactError as stale:
            print(f"refitting: cached mapper at {directory} rejected ({stale})")
    fit_rows, _ = split_rows(cfg, traces)
    began = time.perf_counter()
    mapper = fit_transfer(
        pair.source,
        pair.target,
        fit_rows,
        pair.tokenizer_hash,
        support=support.kind,
        k=fit.k,
        selection=support.selection,
        weighting=cfg.weighting.kind,
        lam=fit.lam,
        lam_relative=fit.lam_relative,
        shift=support.shift,
        chunk_rows=fit.chunk_rows,
        alpha_cap=cfg.weighting.alpha_cap,
        token_features=fit.token_features,
    )
    mapper.manifest["construction_seconds"] = time.perf_counter() - began
    mapper.manifest["weights"] = pair.weights
    mapper.manifest["config"] = OmegaConf.to_container(cfg, resolve=True)
    save_mapper(mapper, directory, fit.coefficient_dtype)
    return load_mapper(directory, fingerprint(pair.source), fingerprint(pair.target), pair.tokenizer_hash)


def _tags(cfg: DictConfig, pair: Pair, job: str) -> dict[str, str]:
    return {
        "job": job,
        "weights": pair.weights,
        "pair": cfg.pair.name,
        "direction": cfg.pair.direction,
        "source_fingerprint": fingerprint(pair.source),
        "target_fingerprint": fingerprint(pair.target),
        "tokenizer_hash": pair.tokenizer_hash,
        "seed": str(cfg.seed),
        "note": "random weights: timing/plumbing only, no quality claim" if pair.weights == "random" else "",
    }


def _plot_layers(scores: dict) -> plt.Figure:
    figure, axis = plt.subplots(figsize=(7, 3))
    layers = range(len(scores["r2_k_layers"]))
    axis.plot(layers, scores["r2_k_layers"], "o-", label="K")
    axis.plot(layers, scores["r2_v_layers"], "s-", label="V")
    axis.set(xlabel="target layer", ylabel="held-out R²", title="mapped-cache fit per target layer")
    axis.legend()
    figure.tight_layout()
    return figure


def native_scores(cfg: DictConfig, pair: Pair, mode: str, task: str) -> TaskScores:
    """Per-item scores of a native model on a task (memoized per process, cached on disk by fingerprints)."""
    limit = cfg.eval.tasks.limit
    key = _key("native", mode, task, limit, fingerprint(pair.source), fingerprint(pair.target), pair.tokenizer_hash)
    path = Path(cfg.paths.home) / "task_scores" / f"{key}.json"
    if key not in _MEMO:
        if path.is_file():
            _MEMO[key] = TaskScores(**json.loads(path.read_text()))
        else:
            _MEMO[key] = score_task(mode, pair, load_task(task, cfg.paths.data, limit))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(vars(_MEMO[key])))
    return _MEMO[key]


def task_metrics(cfg: DictConfig, pair: Pair, transfer: KVTransfer) -> tuple[dict[str, float], dict]:
    """`task.<name>.<metric>` and `task.mean.<metric>` of the transfer against both native models, and the
    per-item scores of every mode (for paired comparisons between runs)."""
    levers, metrics, items, per_task = Levers(**cfg.eval.levers), {}, {}, {}
    for task in cfg.eval.tasks.names:
        source, target = (native_scores(cfg, pair, mode, task) for mode in ("native_source", "native_target"))
        items_of_task = load_task(task, cfg.paths.data, cfg.eval.tasks.limit)
        method = score_task("transfer", pair, items_of_task, transfer, levers)
        per_task[task] = compare(task, source, target, method, cfg.eval.tasks.n_boot)
        metrics |= {f"task.{task}.{name}": value for name, value in per_task[task].items()}
        metrics |= {f"task.{task}.{name}": value for name, value in by_length(method).items()}
        items[task] = {"native_source": vars(source), "native_target": vars(target), "transfer": vars(method)}
    if per_task:
        metrics |= {f"task.mean.{name}": value for name, value in summarize(per_task).items()}
    return metrics, items


def task_prompts(cfg: DictConfig, pair: Pair) -> list[torch.Tensor]:
    """The first context of each evaluated item, as token ids (for fidelity on task prefixes)."""
    prompts = []
    for task in cfg.eval.tasks.names:
        for item in load_task(task, cfg.paths.data, cfg.eval.diagnose.prompts_per_task):
            ids = pair.tokenizer.encode(item.contexts[0], add_special_tokens=False)
            if len(ids) >= 2:
                prompts.append(torch.tensor(ids))
    return prompts


def fit_eval(cfg: DictConfig) -> float:
    torch.manual_seed(cfg.seed)
    pair = load(cfg)
    traces, traces_key = calibration(cfg, pair)
    mapper = build_mapper(cfg, pair, traces, traces_key, cfg.support)
    compute = getattr(torch, cfg.pair.compute_dtype)
    transfer = KVTransfer(mapper, pair.source, pair.target, pair.tokenizer_hash, compute, cfg.pair.apply_backend)
    _, heldout = traces.split_heldout(cfg.budget.heldout_fraction)
    r2 = mapper_r2(transfer.mapper, heldout.to(transfer.device))
    manifest = mapper.manifest
    metrics = {
        "r2_k_heldout": r2["r2_k"],
        "r2_v_heldout": r2["r2_v"],
        "calibration_rows": traces.rows,
        "coefficient_count": manifest["coefficient_count"],
        "artifact_bytes": manifest["tensor_bytes"],
        "construction_seconds": manifest["construction_seconds"],
        "trace_seconds": traces.meta.get("collect_seconds", float("nan")),
    }
    vocab = pair.target.config.get_text_config().vocab_size
    nll_cfg, latency_cfg = cfg.eval.nll, cfg.eval.latency
    streams = token_sequences(
        cfg.paths.data, nll_cfg.corpus, nll_cfg.streams, nll_cfg.prefix_len + nll_cfg.horizon, pair.tokenizer, vocab
    )
    levers = Levers(**cfg.eval.levers)
    metrics |= horizon_nll(transfer, streams, nll_cfg.prefix_len, levers)
    items = {}
    if cfg.eval.tasks.names:
        task_scores, items = task_metrics(cfg, pair, transfer)
        metrics |= task_scores
    if cfg.eval.diagnose.fidelity and cfg.eval.tasks.names:
        metrics |= cache_fidelity(transfer, task_prompts(cfg, pair))
    if cfg.eval.diagnose.swaps:
        metrics |= swap_nll(transfer, streams, nll_cfg.prefix_len)
    prefix = token_sequences(cfg.paths.data, nll_cfg.corpus, 1, latency_cfg.prefix_len, pair.tokenizer, vocab)
    metrics |= handoff_latency(transfer, prefix, latency_cfg.repeats, latency_cfg.warmup, levers)
    if cfg.eval.rollback:
        metrics |= verify_rollback(transfer, prefix)
    if torch.cuda.is_available():
        metrics["gpu_peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    run_name = f"{cfg.pair.name}:{manifest['method']}:k{cfg.fit.k}"
    if cfg.fit.sequences is not None:
        run_name += f":n{cfg.fit.sequences}"
    if levers:
        run_name += f":sink{levers.native_sink}:hold{levers.hold_back}:layers{levers.native_layers}"
    with tracking.job_run(
        cfg,
        run_name,
        _tags(cfg, pair, "fit_eval") | {"method": manifest["method"], "corpus_hash": traces.meta["corpus_hash"]},
    ) as run:
        run.metrics(metrics)
        run.dict(manifest, "mapper/manifest.json")
        if items:
            run.dict(items, "tasks/item_scores.json")
        run.figure(_plot_layers(r2), "plots/r2_by_layer.png")
    print(f"\n{run_name}  (weights={pair.weights})")
    for name in (
        "r2_k_heldout",
        "r2_v_heldout",
        "nll_native_source",
        "nll_native_target",
        "nll_transfer",
        "nll_gap_recovered",
        "task.mean.acc_source",
        "task.mean.acc_target",
        "task.mean.acc",
        "task.mean.loss_points",
        "task.mean.gap_recovered",
        "task.mean.prefill_fraction",
        "apply_ms_p50",
        "prefill_ms_p50",
        "handoff_speedup",
        "rollback_verified",
    ):
        if name in metrics:
            print(f"  {name:<26} {metrics[name]:10.4f}")
    print(f"  open the tracking UI: mlflow ui --backend-store-uri {cfg.tracking.uri}")
    return float(metrics[cfg.objective])


def feature_probe(cfg: DictConfig) -> float:
    """Held-out R² of the Head-Local design widened per `eval.probe.variants`, on the pair's traces;
    returns the last variant's held-out V R² (what a sweep over the probe would read)."""
    torch.manual_seed(cfg.seed)
    pair = load(cfg)
    traces, _ = calibration(cfg, pair)
    fit, heldout = split_rows(cfg, traces)
    source_kv, target_kv = describe_kv(pair.source), describe_kv(pair.target)
    head_index = head_assignment("local", source_kv.num_kv_heads, target_kv.num_kv_heads)
    source_layers, _ = layers_for_support(fit, "local", cfg.fit.k, cfg.support.selection, cfg.fit.chunk_rows)
    probe = cfg.eval.probe
    began = time.perf_counter()
    scores = probe_features(
        fit,
        heldout,
        source_layers,
        head_index,
        list(probe.variants),
        cfg.fit.lam,
        cfg.fit.lam_relative,
        cfg.fit.chunk_rows,
        probe.relu_width,
        cfg.seed,
    )
    metrics = {name: value for name, value in scores.items() if not isinstance(value, list)}
    metrics |= {"calibration_rows": fit.rows, "probe_seconds": time.perf_counter() - began}
    run_name = f"{cfg.pair.name}:probe:k{cfg.fit.k}"
    with tracking.job_run(
        cfg, run_name, _tags(cfg, pair, "probe") | {"corpus_hash": traces.meta["corpus_hash"]}
    ) as run:
        run.metrics(metrics)
        run.dict({"source_layers": source_layers.tolist()} | scores, "probe/scores.json")
    print(f"\n{run_name}  (weights={pair.weights}, {fit.rows} fit rows)")
    print(
        f"  {'variant':<8} {'width K':>8} {'R² K fit':>9} {'R² K held':>10} {'width V':>8} {'R² V fit':>9} {'R² V held':>10}"
    )
    for variant in probe.variants:
        row = [scores[f"{variant}.{name}"] for name in ("width_k", "r2_k_fit", "r2_k_heldout")]
        row += [scores[f"{variant}.{name}"] for name in ("width_v", "r2_v_fit", "r2_v_heldout")]
        print(f"  {variant:<8} {row[0]:8.0f} {row[1]:9.4f} {row[2]:10.4f} {row[3]:8.0f} {row[4]:9.4f} {row[5]:10.4f}")
    return float(scores[f"{probe.variants[-1]}.r2_v_heldout"])


@hydra.main(version_base="1.3", config_path="../conf", config_name="run")
def main(cfg: DictConfig) -> float | None:
    if cfg.job == "fit_eval":
        return fit_eval(cfg)
    if cfg.job == "probe":
        return feature_probe(cfg)
    if cfg.job in SYSTEMS_JOBS:
        from src import bench

        return getattr(bench, cfg.job)(cfg)
    if cfg.job == "gate":
        from src.gate import check

        sys.exit(
            check(
                cfg.tracking.uri, cfg.gate.experiment, cfg.gate.parent, cfg.gate.min_speedup, cfg.gate.max_loss_points
            )
        )
    if cfg.job == "optuna":
        from src.sweep import optimize

        return optimize(cfg, fit_eval)
    raise ValueError(f"unknown job {cfg.job!r}")


if __name__ == "__main__":
    main()
