"""The job: `python -m src.run +experiment=NAME` (Hydra). The only module that reads the whole cfg.

fit_eval: load pair → calibration traces (cached) → select + fit (cached artifact) → verify by
reloading → held-out R², horizon NLL, handoff latency, rollback → MLflow. Other jobs: latency,
construction, gate, optuna.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import hydra
import matplotlib
import mlflow
import torch
from omegaconf import DictConfig, OmegaConf

from src import tracking
from src.apply import KVTransfer
from src.artifact import ArtifactError, Mapper, load_mapper, save_mapper
from src.corpus import token_sequences
from src.eval.latency import handoff_latency
from src.eval.nll import horizon_nll
from src.eval.rollback import verify_rollback
from src.fit import fit_mapper, fit_transfer, mapper_r2
from src.gate import check
from src.models import Pair, fingerprint, load_pair
from src.select import layers_for_support
from src.support import head_assignment
from src.traces import Traces, collect_traces, corpus_hash, load_traces, save_traces

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def load(cfg: DictConfig) -> Pair:
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
    vocab = pair.target.config.get_text_config().vocab_size
    ids = token_sequences(cfg.paths.data, budget.corpus, budget.sequences, budget.seq_len, pair.tokenizer, vocab)
    key = _key(fingerprint(pair.source), fingerprint(pair.target), corpus_hash(ids), OmegaConf.to_container(budget))
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
    return traces, key


def build_mapper(cfg: DictConfig, pair: Pair, traces: Traces, traces_key: str, support: DictConfig) -> Mapper:
    """Fit on the non-held-out rows (or reuse the verified cached artifact for the same inputs)."""
    fit = cfg.fit
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
    fit_rows, _ = traces.split_heldout(cfg.budget.heldout_fraction)
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
    )
    mapper.manifest["construction_seconds"] = time.perf_counter() - began
    mapper.manifest["weights"] = pair.weights
    mapper.manifest["config"] = OmegaConf.to_container(cfg, resolve=True)
    save_mapper(mapper, directory, fit.coefficient_dtype)
    return load_mapper(directory, fingerprint(pair.source), fingerprint(pair.target), pair.tokenizer_hash)


def _tags(cfg: DictConfig, pair: Pair, traces: Traces, job: str) -> dict[str, str]:
    return {
        "job": job,
        "weights": pair.weights,
        "pair": cfg.pair.name,
        "direction": cfg.pair.direction,
        "source_fingerprint": fingerprint(pair.source),
        "target_fingerprint": fingerprint(pair.target),
        "tokenizer_hash": pair.tokenizer_hash,
        "corpus_hash": traces.meta["corpus_hash"],
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


def fit_eval(cfg: DictConfig) -> float:
    torch.manual_seed(cfg.seed)
    pair = load(cfg)
    traces, traces_key = calibration(cfg, pair)
    mapper = build_mapper(cfg, pair, traces, traces_key, cfg.support)
    transfer = KVTransfer(mapper, pair.source, pair.target, pair.tokenizer_hash)
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
    metrics |= horizon_nll(transfer, streams, nll_cfg.prefix_len)
    prefix = token_sequences(cfg.paths.data, nll_cfg.corpus, 1, latency_cfg.prefix_len, pair.tokenizer, vocab)
    metrics |= handoff_latency(transfer, prefix, latency_cfg.repeats, latency_cfg.warmup)
    if cfg.eval.rollback:
        metrics |= verify_rollback(transfer, prefix)
    if torch.cuda.is_available():
        metrics["gpu_peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    run_name = f"{cfg.pair.name}:{manifest['method']}:k{cfg.fit.k}"
    with tracking.job_run(cfg, run_name, _tags(cfg, pair, traces, "fit_eval") | {"method": manifest["method"]}):
        mlflow.log_metrics(metrics)
        mlflow.log_dict(manifest, "mapper/manifest.json")
        mlflow.log_figure(_plot_layers(r2), "plots/r2_by_layer.png")
    print(f"\n{run_name}  (weights={pair.weights})")
    for name in (
        "r2_k_heldout",
        "r2_v_heldout",
        "nll_native_source",
        "nll_native_target",
        "nll_transfer",
        "nll_gap_recovered",
        "apply_ms_p50",
        "prefill_ms_p50",
        "handoff_speedup",
        "rollback_verified",
    ):
        if name in metrics:
            print(f"  {name:<20} {metrics[name]:10.4f}")
    print(f"  open the tracking UI: mlflow ui --backend-store-uri {cfg.tracking.uri}")
    return float(metrics[cfg.objective])


def latency(cfg: DictConfig) -> None:
    """Apply latency per support vs re-prefill, over prefix lengths, in one process."""
    pair = load(cfg)
    traces, traces_key = calibration(cfg, pair)
    vocab = pair.target.config.get_text_config().vocab_size
    lengths = list(cfg.eval.latency.prefix_lens)
    ids = token_sequences(cfg.paths.data, cfg.eval.nll.corpus, 1, max(lengths), pair.tokenizer, vocab)
    results: dict[str, dict[int, dict]] = {}
    for kind in ("full", "local"):
        support = OmegaConf.merge(cfg.support, {"kind": kind, "shift": 0})
        transfer = KVTransfer(
            build_mapper(cfg, pair, traces, traces_key, support), pair.source, pair.target, pair.tokenizer_hash
        )
        results[kind] = {
            n: handoff_latency(transfer, ids[:, :n], cfg.eval.latency.repeats, cfg.eval.latency.warmup) for n in lengths
        }
    figure, axis = plt.subplots(figsize=(6, 4))
    for kind, by_length in results.items():
        axis.plot(lengths, [by_length[n]["apply_ms_p50"] for n in lengths], "o-", label=f"apply {kind}")
    axis.plot(lengths, [results["local"][n]["prefill_ms_p50"] for n in lengths], "k--", label="target re-prefill")
    axis.set(xlabel="prefix tokens", ylabel="ms (p50)", xscale="log", yscale="log", title=f"{cfg.pair.name}")
    axis.legend()
    with tracking.job_run(cfg, f"{cfg.pair.name}:latency", _tags(cfg, pair, traces, "latency")):
        for kind, by_length in results.items():
            for n, metrics in by_length.items():
                mlflow.log_metrics({f"{name}.{kind}": value for name, value in metrics.items()}, step=n)
        mlflow.log_dict({k: {str(n): m for n, m in v.items()} for k, v in results.items()}, "latency.json")
        mlflow.log_figure(figure, "plots/latency_vs_prefix.png")
    for n in lengths:
        print(
            f"prefix {n:>6}: apply full {results['full'][n]['apply_ms_p50']:.2f} ms, local "
            f"{results['local'][n]['apply_ms_p50']:.2f} ms, re-prefill {results['local'][n]['prefill_ms_p50']:.2f} ms"
        )


def construction(cfg: DictConfig) -> None:
    """Fit time vs calibration budget (nested prefixes), generic (materialized) vs streaming statistics."""
    pair = load(cfg)
    traces, _ = calibration(cfg, pair)
    budgets = [b for b in cfg.eval.construction.budgets if b <= cfg.budget.sequences] or [cfg.budget.sequences]
    heads = head_assignment(cfg.support.kind, traces.source_k.shape[1], traces.target_k.shape[1], cfg.support.shift)
    layers, _ = layers_for_support(traces, cfg.support.kind, cfg.fit.k, cfg.support.selection, cfg.fit.chunk_rows)
    rows: dict[int, dict[str, float]] = {}
    for budget in budgets:
        subset = traces.select_rows(torch.nonzero(traces.sequence_index < budget)[:, 0])
        timing: dict[str, list[float]] = {"generic": [], "streaming": []}
        mappers = {}
        for path in timing:
            for _ in range(cfg.eval.construction.repeats):
                began = time.perf_counter()
                mappers[path] = fit_mapper(
                    subset,
                    layers,
                    heads,
                    cfg.support.kind,
                    cfg.weighting.kind,
                    cfg.fit.lam,
                    cfg.fit.lam_relative,
                    cfg.fit.chunk_rows,
                    reference=path == "generic",
                    alpha_cap=cfg.weighting.alpha_cap,
                )
                timing[path].append(time.perf_counter() - began)
        difference = max(
            float((generic - streaming).abs().max() / generic.abs().max())
            for generic, streaming in zip(
                mappers["generic"].tensors().values(), mappers["streaming"].tensors().values(), strict=True
            )
            if generic.is_floating_point()
        )
        rows[budget] = {f"{p}_seconds": float(torch.tensor(t).median()) for p, t in timing.items()}
        rows[budget]["max_relative_difference"] = difference
        print(
            f"{budget:>5} sequences ({subset.rows} rows): generic {rows[budget]['generic_seconds']:.3f} s, "
            f"streaming {rows[budget]['streaming_seconds']:.3f} s, max rel diff {difference:.2e}"
        )
    figure, axis = plt.subplots(figsize=(6, 4))
    for path in ("generic", "streaming"):
        axis.plot(budgets, [rows[b][f"{path}_seconds"] for b in budgets], "o-", label=path)
    axis.set(xlabel="calibration sequences", ylabel="construction s (median)", yscale="log", title=cfg.pair.name)
    axis.legend()
    with tracking.job_run(cfg, f"{cfg.pair.name}:construction", _tags(cfg, pair, traces, "construction")):
        for budget, metrics in rows.items():
            mlflow.log_metrics(metrics, step=budget)
        mlflow.log_figure(figure, "plots/construction_vs_budget.png")


@hydra.main(version_base="1.3", config_path="../conf", config_name="run")
def main(cfg: DictConfig) -> float | None:
    if cfg.job == "fit_eval":
        return fit_eval(cfg)
    if cfg.job == "latency":
        return latency(cfg)
    if cfg.job == "construction":
        return construction(cfg)
    if cfg.job == "gate":
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
