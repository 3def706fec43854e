"""The job: `python -m src.run +experiment=NAME` (Hydra) — dispatch by `cfg.job` (JOBS) and the fit/eval job.

fit_eval, top to bottom: load pair → calibration traces (cached) → select + fit (cached artifact) → bind to the
pair → held-out R², horizon NLL, task accuracy vs both native models, fidelity on task prompts, native-swap
attribution, handoff latency, rollback → MLflow, then print every logged metric. probe: held-out R² of wider
closed-form maps on the same traces (src/probe.py). Config → objects lives in src/pipeline.py; the systems jobs
in src/bench.py; the routed-workload job in src/routed.py; the Optuna study in src/sweep.py; the gate in src/gate.py.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from collections.abc import Callable

import hydra
import matplotlib
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from src import bench, tracking
from src.apply import KVTransfer
from src.config_check import ConfigError, check_config
from src.corpus import VALIDATION, heldout_sequences
from src.eval.accuracy import by_length, compare, score_task, summarize
from src.eval.diagnose import cache_fidelity, swap_nll
from src.eval.latency import handoff_latency
from src.eval.metrics import mapper_r2
from src.eval.nll import horizon_nll
from src.eval.rollback import verify_rollback
from src.models import Pair, describe_kv
from src.pipeline import (
    build_mapper,
    calibration,
    load,
    make_transfer,
    native_scores,
    split_rows,
    tags,
    text_ids,
    vocab_size,
)
from src.probe import probe_features
from src.routed import routed
from src.runtime.plan import Levers
from src.runtime.routing import policy_from
from src.select import layers_for_support
from src.support import head_assignment
from src.tasks import load_task

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _plot_layers(scores: dict) -> plt.Figure:
    figure, axis = plt.subplots(figsize=(7, 3))
    layers = range(len(scores["r2_k_layers"]))
    axis.plot(layers, scores["r2_k_layers"], "o-", label="K")
    axis.plot(layers, scores["r2_v_layers"], "s-", label="V")
    axis.set(xlabel="target layer", ylabel="held-out R²", title="mapped-cache fit per target layer")
    axis.legend()
    figure.tight_layout()
    return figure


def task_metrics(cfg: DictConfig, pair: Pair, transfer: KVTransfer) -> tuple[dict[str, float], dict]:
    """`task.<name>.<metric>` and `task.mean.<metric>` of the transfer against both native models, and the
    per-item scores of every mode (for paired comparisons between runs)."""
    levers, metrics, items, per_task = policy_from(cfg.policy).levers, {}, {}, {}
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
    with tracking.job_run(cfg, f"{cfg.pair.name}:fit_eval", {"job": "fit_eval"}) as run:  # spans the whole job
        torch.manual_seed(cfg.seed)
        pair = load(cfg)
        traces, traces_key = calibration(cfg, pair)
        mapper = build_mapper(cfg, pair, traces, traces_key, cfg.support)
        transfer = make_transfer(cfg, pair, mapper)
        manifest, levers = mapper.manifest, policy_from(cfg.policy).levers
        run.rename(run_name(cfg, manifest["method"], levers))
        run.tags(
            tags(cfg, pair, "fit_eval") | {"method": manifest["method"], "corpus_hash": traces.meta["corpus_hash"]}
        )
        fit_rows, heldout = split_rows(cfg, traces)
        r2 = mapper_r2(transfer.mapper, heldout.to(transfer.device))
        metrics = {
            "r2_k_heldout": r2["r2_k"],
            "r2_v_heldout": r2["r2_v"],
            "calibration_rows": fit_rows.rows,
            "heldout_rows": heldout.rows,
            "coefficient_count": manifest["coefficient_count"],
            "artifact_bytes": manifest["tensor_bytes"],
            "construction_seconds": manifest["construction_seconds"],
            "trace_seconds": traces.meta.get("collect_seconds", float("nan")),
        }
        nll, latency = cfg.eval.nll, cfg.eval.latency
        streams = text_ids(cfg, pair, nll.corpus, nll.streams, nll.prefix_len + nll.horizon)  # reported, not tuned on
        metrics |= horizon_nll(transfer, streams, nll.prefix_len, levers)
        valid = heldout_sequences(  # the tail of the validation text: disjoint from every calibration budget
            cfg.paths.data,
            nll.valid_corpus,
            nll.streams,
            nll.prefix_len + nll.horizon,
            pair.tokenizer,
            vocab_size(pair),
        )
        valid_nll = horizon_nll(transfer, valid, nll.prefix_len, levers)
        metrics |= {f"{VALIDATION}{name}": value for name, value in valid_nll.items()}  # what sweeps read
        items = {}
        if cfg.eval.tasks.names:
            task_scores, items = task_metrics(cfg, pair, transfer)
            metrics |= task_scores
            if cfg.eval.diagnose.fidelity:
                metrics |= cache_fidelity(transfer, task_prompts(cfg, pair))
        if cfg.eval.diagnose.swaps:
            metrics |= swap_nll(transfer, streams, nll.prefix_len)
        prefix = text_ids(cfg, pair, nll.corpus, 1, latency.prefix_len)
        metrics |= handoff_latency(transfer, prefix, latency.repeats, latency.warmup, levers)
        if cfg.eval.rollback:
            metrics |= verify_rollback(transfer, prefix)
        if torch.cuda.is_available():
            metrics["gpu_peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        run.metrics(metrics)
        run.dict(manifest, "mapper/manifest.json")
        if items:
            run.dict(items, "tasks/item_scores.json")
        run.figure(_plot_layers(r2), "plots/r2_by_layer.png")
        print(f"\n{run_name(cfg, manifest['method'], levers)}  (weights={pair.weights})")
        print_metrics(metrics)
        print("  " + run.where())
    return float(metrics[cfg.objective])


def run_name(cfg: DictConfig, method: str, levers: Levers) -> str:
    """pair:method:k, then the budget and lever settings that differ from the defaults."""
    name = f"{cfg.pair.name}:{method}:k{cfg.fit.k}"
    if cfg.fit.sequences is not None:
        name += f":n{cfg.fit.sequences}"
    if levers:
        name += f":sink{levers.native_sink}:hold{levers.hold_back}:layers{levers.native_layers}"
        if levers.recompute:
            name += f":recompute{levers.recompute}:{levers.recompute_rule}"
            name += f":progressive{levers.progressive}" if levers.progressive < 1 else ""
    return name


def print_metrics(metrics: dict[str, float]) -> None:
    """Every logged metric: run-level ones one per line, `task.<name>.<metric>` as a task × metric table."""
    per_task: dict[str, dict[str, float]] = {}
    for name, value in sorted(metrics.items()):
        if name.startswith("task."):
            task, metric = name[len("task.") :].split(".", 1)
            per_task.setdefault(task, {})[metric] = value
        else:
            print(f"  {name:<34} {value:12.4f}")
    if per_task:
        columns = sorted({metric for row in per_task.values() for metric in row})
        print("  " + "task".ljust(12) + "".join(c[:14].rjust(15) for c in columns))
        for task, row in per_task.items():
            print("  " + task.ljust(12) + "".join(f"{row.get(c, float('nan')):15.4f}" for c in columns))


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
    with tracking.job_run(cfg, run_name, tags(cfg, pair, "probe") | {"corpus_hash": traces.meta["corpus_hash"]}) as run:
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


def gate(cfg: DictConfig) -> None:
    """The promotion gate on `gate.experiment`; the process exits non-zero on FAIL."""
    from src.gate import check  # MLflow: not on the GPU image, which runs the other jobs with JSON tracking

    g = cfg.gate
    sys.exit(
        check(
            cfg.tracking.uri,
            g.experiment,
            g.parent,
            g.min_speedup,
            g.max_loss_points,
            g.run,
            g.max_harness_skew,
            g.max_prefill_fraction,
        )
    )


def optimize(cfg: DictConfig) -> float:
    """The Optuna study over the fit/eval job (src/sweep.py; MLflow, so imported when asked for)."""
    from src.sweep import optimize as study

    return study(cfg, fit_eval)


JOBS: dict[str, Callable[[DictConfig], float | None]] = {
    "fit_eval": fit_eval,
    "probe": feature_probe,
    "latency": bench.latency,
    "construction": bench.construction,
    "handoff": bench.handoff,
    "gate": gate,
    "optuna": optimize,
    "routed": routed,
}


@hydra.main(version_base="1.3", config_path="../conf", config_name="run")
def main(cfg: DictConfig) -> float | None:
    try:  # first: nothing loads and no MLflow run opens before the config holds (src/config_check.py)
        check_config(cfg, JOBS)
    except ConfigError as error:
        sys.exit(f"config: {error}")
    try:
        return JOBS[cfg.job](cfg)
    except Exception:  # a sweep's launcher reports a job's error only after every job: a sweep cut short by a
        # deadline never would (nor a job failing before its record opened)
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            overrides = " ".join(HydraConfig.get().overrides.task)
            print(f"job failed ({overrides}):\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:  # a job's engines sit in reference cycles, which the collector frees only when its object counts say
        # so: the next job of a sweep would find their CUDA graph pools and caches still held
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
